"""Attention in plain XLA ops: materialised probabilities, query blocks, and jax's fused attention.

Shapes: q [B,Hq,n,D] (query head h uses KV head h // G, G = Hq // Hkv; GQA queries are reshaped,
keys never repeated), keys `Keys` (k, v [B,Hkv,S,D], pos [B,Hkv,S]), q_pos [B,n] (-1 = padding).
Query i sees slot s iff 0 <= pos[s] <= q_pos[i] (and q_pos[i] - pos[s] < window when given);
softcap: logits -> softcap * tanh(logits / softcap) before masking (Gemma 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels.column_mass.api import column_mass as column_mass_op
from kvjax.kernels._common import masked_softmax, resolve_implementation

QUERY_BLOCK = 1024  # `blocked` attends in query blocks of this many rows


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)`; x unchanged when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


_apply_softcap = softcap  # for the functions below, whose `softcap` argument shadows the name


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float, *,
           window: int | None = None, softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal attention by position over masked slots, probabilities materialised.
    Returns out [B,Hq,n,D] (q dtype) and probs [B,Hkv,G,n,S] float32 (zero rows where nothing is seen)."""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, n, D)
    logits = jnp.einsum("bhgnd,bhsd->bhgns", qg, k, preferred_element_type=jnp.float32) * scale
    logits = _apply_softcap(logits, softcap)
    mask = (k_pos[:, :, None, None, :] >= 0) & (k_pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    if window is not None:
        mask &= k_pos[:, :, None, None, :] > q_pos[:, None, None, :, None] - window
    probs = masked_softmax(logits, mask)
    out = jnp.einsum("bhgns,bhsd->bhgnd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, Hq, n, D), probs


def attend_blocked(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
                   block: int, column_mass: bool = False, *, window: int | None = None,
                   softcap: float | None = None) -> tuple[jax.Array, jax.Array | None]:
    """`attend` over query blocks of `block` rows (n a multiple of it), so no [n, S] matrix exists at
    once. Returns out [B,Hq,n,D] and, when asked, the column mass [B,Hkv,S] float32: per key, the
    probability summed over every valid query and over the query group."""
    B, Hq, n, D = q.shape
    nb = n // block
    qb = q.reshape(B, Hq, nb, block, D).transpose(2, 0, 1, 3, 4)
    pb = q_pos.reshape(B, nb, block).transpose(1, 0, 2)

    def one(mass, xs):
        qi, pi = xs
        out, probs = attend(qi, k, v, pi, k_pos, scale, window=window, softcap=softcap)
        if column_mass:  # padding queries see no key, so their probability rows are already zero
            mass = mass + jnp.sum(probs, axis=(2, 3))
        return mass, out

    mass, out = jax.lax.scan(one, jnp.zeros(k.shape[:3], jnp.float32), (qb, pb))
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, Hq, n, D)
    return out, (mass if column_mass else None)


def blocked_column_mass(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
                        *, window: int | None, softcap: float | None, want_mass: bool
                        ) -> tuple[jax.Array, jax.Array | None]:
    """`attend_blocked` in blocks of `QUERY_BLOCK`, with the column mass when asked: summed in the
    blocks in XLA (or with soft-capped logits, which the column-mass kernel does not apply), else by
    the column-mass kernel on TPU/GPU."""
    in_blocks = want_mass and (resolve_implementation(None, "column_mass") == "xla" or softcap is not None)
    out, mass = attend_blocked(q, k, v, q_pos, k_pos, scale, QUERY_BLOCK, in_blocks, window=window,
                               softcap=softcap)
    if want_mass and not in_blocks:
        mass = column_mass_op(q, k, q_pos, k_pos, scale=scale)
    return out, mass


def fused(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """jax's fused attention for a right-padded batch attending to its own tokens (training, no cache):
    causal by index, so a real query sees only real keys. out [B,Hq,n,D]."""
    out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                       scale=scale, is_causal=True)
    return out.transpose(0, 2, 1, 3)
