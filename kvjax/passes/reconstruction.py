"""KVzip's reconstruction (arXiv 2505.23416): a pass the engine runs after the prefill, in which the model
repeats the context, and every prompt key scores the most attention it receives.

For each chunk of the prompt the model runs one `extend` of [instruction, chunk] against a copy of the
prefilled cache grown by the chunk's length (so the prompt cache itself is never changed), records
that pass's post-RoPE queries, and each key of the chunk scores the max over its group's query heads
and over the pass's queries of the softmax over the subsampled keys (sinks, the chunk, the pass's own
keys). Cost: the passes together re-read the whole prompt once more against the full cache (about one
more prefill), plus that subsampled attention.

Field: reconstruction [L,B,Hkv,C] float32 (0 for slots no pass scored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels import masked_softmax
from kvjax.models.config import ModelConfig
from kvjax.models.forward import extend
from kvjax.observations.base import Observation
from kvjax.observations.spec import ObservationSpec


@dataclasses.dataclass(frozen=True)
class Reconstruction(Observation):
    """The pass's configuration. The prompt is cut into chunks of `chunk_size` tokens; chunk i is fed
    against the prefilled cache as [first_ids (i = 0) or next_ids + the last `postfix` tokens of chunk
    i-1 (i > 0), suffix_ids, chunk i], at positions T, T+1, ... Each key of chunk i scores the max, over
    the query heads of its group and over that pass's queries, of the softmax over the keys {sinks:
    positions < min(n_sink, chunk start)} + {chunk i} + {the pass's own keys, causal}; the pass's keys
    are then dropped (the prompt cache is unchanged)."""

    chunk_size: int = 2048
    n_sink: int = 4
    postfix: int = 8
    first_ids: tuple[int, ...] = ()
    next_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()

    keyword = "reconstruction"
    fields = ("reconstruction",)
    producer = True

    @classmethod
    def from_keyword(cls, value: Any) -> None:
        if value is not None:
            raise TypeError(f"reconstruction= takes a Reconstruction (or None), got {type(value).__name__}")
        return None

    @classmethod
    def absent(cls) -> None:
        return None

    def value(self) -> Reconstruction:
        return self

    def produce(self, params: Any, cfg: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array, *,
                rope_mode: str, inputs: Any) -> dict[str, jax.Array]:
        return {"reconstruction": reconstruction_scores(params, cfg, cache, tokens, positions, self, rope_mode)}


QUERY_BLOCK = 256  # reconstruction queries scored at once ([B,Hq,block,slots] probabilities)


def _chunk_max(q: jax.Array, qpos: jax.Array, cache: KVCache, lengths: jax.Array, start: int, end: int,
               n_sink: int, scale: float) -> jax.Array:
    """[L,B,Hkv,C] float32: per key of the chunk [start, end), the max over group heads and queries
    of the subsampled softmax. q [L,B,Hq,n,D] post-RoPE, qpos [B,n] absolute (-1 = padding)."""
    _, B, Hq, n, D = q.shape
    Hkv = cache.k.shape[2]
    G = Hq // Hkv
    nb = -(-n // QUERY_BLOCK)
    pad = nb * QUERY_BLOCK - n
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
    qpos = jnp.pad(qpos, ((0, 0), (0, pad)), constant_values=-1)
    sink = min(n_sink, start)

    def layer(xs):
        ql, kl, pl, vl = xs  # [B,Hq,n',D], [B,Hkv,C,D], [B,Hkv,C], [B,Hkv,C]
        chunk = vl & (pl >= start) & (pl < jnp.minimum(end, lengths)[:, None, None])  # prompt keys only
        own = vl & (pl >= lengths[:, None, None])  # the pass's keys (positions after the prompt)
        base = vl & (pl < sink) | chunk

        def block(best, i):
            qb = jax.lax.dynamic_slice_in_dim(ql, i * QUERY_BLOCK, QUERY_BLOCK, axis=2)
            pb = jax.lax.dynamic_slice_in_dim(qpos, i * QUERY_BLOCK, QUERY_BLOCK, axis=1)
            logits = jnp.einsum("bhgnd,bhcd->bhgnc", qb.reshape(B, Hkv, G, QUERY_BLOCK, D), kl,
                                preferred_element_type=jnp.float32) * scale
            see = base[:, :, None, None, :] | (own[:, :, None, None, :] & (pl[:, :, None, None, :]
                                                                          <= pb[:, None, None, :, None]))
            see = see & (pb >= 0)[:, None, None, :, None]
            probs = jnp.where(chunk[:, :, None, None, :], masked_softmax(logits, see), 0.0)
            return jnp.maximum(best, probs.max((2, 3))), None

        best, _ = jax.lax.scan(block, jnp.zeros(vl.shape, jnp.float32), jnp.arange(nb))
        return best

    return jax.lax.map(layer, (q, cache.k, cache.pos, cache.valid))


def reconstruction_scores(params: Any, cfg: ModelConfig, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                          spec: Reconstruction, rope_mode: str = "original") -> jax.Array:
    """KVzip's scores [L,B,Hkv,C] float32 for a prefilled `cache` of the right-padded prompts
    tokens / positions [B,T] (-1 = padding). Slots outside every row's prompt get 0."""
    B, T = tokens.shape
    C = cache.capacity
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    out = jnp.zeros(cache.valid.shape, jnp.float32)
    scale = cfg.head_dim**-0.5
    for i in range(-(-T // spec.chunk_size)):
        start, end = i * spec.chunk_size, min((i + 1) * spec.chunk_size, T)
        post = min(spec.postfix, start) if i else 0
        instr = spec.first_ids if i == 0 else spec.next_ids
        head = jnp.broadcast_to(jnp.asarray(instr, jnp.int32)[None], (B, len(instr)))
        tail = jnp.broadcast_to(jnp.asarray(spec.suffix_ids, jnp.int32)[None], (B, len(spec.suffix_ids)))
        ids = jnp.concatenate([head, tokens[:, start - post:start], tail, tokens[:, start:end]], axis=1)
        n, p = ids.shape[1], ids.shape[1] - (end - start)
        index = jnp.arange(n)
        real = (index[None] < p) | (start + index[None] - p < lengths[:, None])
        real = real & (lengths > start)[:, None]  # a row whose prompt ends before the chunk sits out
        pos = jnp.where(real, lengths[:, None] + index[None], -1).astype(jnp.int32)
        _, grown, obs = extend(params, cfg, cache.grow(C + n), ids, pos, fresh=False,
                               observe=ObservationSpec(window=n), rope_mode=rope_mode)
        best = _chunk_max(obs.window_queries, obs.window_positions, grown, lengths, start, end, spec.n_sink, scale)
        out = out + best[..., :C]
    return out
