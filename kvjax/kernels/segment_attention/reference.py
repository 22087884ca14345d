"""Decode attention over a segmented (ragged) per-row buffer, in XLA.

Each row's keys/values lie in one flat buffer [B, S, D] in which KV head h owns the slots whose
segment id is h (contiguous, in head order: `kvjax.cache_ragged.SegmentedLayer`). The work is
proportional to the S stored slots, not to Hkv times the largest head: each slot's logits are taken
with the G query heads of its own group only (gathered by segment id), and the softmax runs per
segment (`jax.ops.segment_max` / `segment_sum`, the segments sorted). No Pallas kernel yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.kernels._common import MASK_VALUE


def segment_decode_attention(query: jax.Array, keys: jax.Array, values: jax.Array, seg: jax.Array, *,
                             num_kv_heads: int, scale: float, softcap: float | None = None) -> jax.Array:
    """One decode step of attention over segmented slots.

    query [B,Hq,D] (query head q uses KV head q // G); keys, values [B,S,D]; seg [B,S] int32: the KV
    head each slot belongs to, nondecreasing along S where >= 0, and -1 for slots that are not
    attended (empty, or past the last segment; their contents are never read into the result).
    softcap: logits -> softcap * tanh(logits / softcap) before the softmax (Gemma 2).
    Returns out [B,Hq,D] in the query dtype; a head with no attended slot gets 0 (never NaN).
    """
    out, _ = segment_decode_attention_lse(query, keys, values, seg, num_kv_heads=num_kv_heads, scale=scale,
                                          softcap=softcap)
    return out.astype(query.dtype)


def segment_decode_attention_lse(query: jax.Array, keys: jax.Array, values: jax.Array, seg: jax.Array, *,
                                 num_kv_heads: int, scale: float, softcap: float | None = None
                                 ) -> tuple[jax.Array, jax.Array]:
    """`segment_decode_attention` with its log-sum-exp, to be merged with attention over other keys:
    out [B,Hq,D] float32 (0 for a head with no attended slot) and lse [B,Hq] float32 (`MASK_VALUE` for
    such a head)."""
    B, Hq, D = query.shape
    S = keys.shape[1]
    H = num_kv_heads
    G = Hq // H
    ok = seg >= 0
    h = jnp.where(ok, seg, 0)
    # sorted segment ids over the whole batch: an unattended slot joins the segment of the last head
    # at or before it (its weight is zero), so the ids stay nondecreasing
    h = jax.lax.cummax(h, axis=1)
    ids = (jnp.arange(B, dtype=jnp.int32)[:, None] * H + h).reshape(B * S)
    qs = jnp.take_along_axis(query.reshape(B, H, G, D), h[:, :, None, None], axis=1)  # [B,S,G,D]
    logits = jnp.einsum("bsgd,bsd->bsg", qs, keys.astype(qs.dtype), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(ok[..., None], logits, -jnp.inf).reshape(B * S, G)
    n = B * H
    m = jax.ops.segment_max(logits, ids, num_segments=n, indices_are_sorted=True)  # [n, G]
    p = jnp.where(ok.reshape(B * S, 1), jnp.exp(logits - m[ids]), 0.0)
    denom = jax.ops.segment_sum(p, ids, num_segments=n, indices_are_sorted=True)
    vals = jnp.where(ok[..., None], values, jnp.zeros((), values.dtype)).reshape(B * S, 1, D)
    num = jax.ops.segment_sum(p[..., None] * vals.astype(jnp.float32), ids, num_segments=n, indices_are_sorted=True)
    seen = denom > 0
    out = num / jnp.where(seen, denom, 1.0)[..., None]
    lse = jnp.where(seen, jnp.where(seen, m, 0.0) + jnp.log(jnp.where(seen, denom, 1.0)), MASK_VALUE)
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)
