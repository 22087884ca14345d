"""jax's splash attention (Mosaic TPU flash attention with block-sparse masks) for a prefill's
self-attention: no kvjax kernel, the one from `jax.experimental.pallas.ops.tpu`.

Splash is causal by index, so it equals `flash_xla.flash_attention` only when every row's real
positions increase along the index (`index_causal`); the attention op runs it under a `lax.cond`
that falls back to the flash path otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import _compat

SPLASH_BLOCK = 128  # splash attention's default block sizes: the prefill length must be a multiple


def index_causal(q_pos: jax.Array) -> jax.Array:
    """Scalar bool: in every row of q_pos [B,n] the real positions (>= 0) increase along the index, so
    that among real tokens "key position <= query position" is "key index <= query index"."""
    real = q_pos >= 0
    seen = jax.lax.cummax(jnp.where(real, q_pos, -1), axis=1)
    before = jnp.pad(seen[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return jnp.all(~real | (q_pos > before))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float, *,
                     window: int | None = None, softcap: float | None = None, interpret: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
    """A prefill's self-attention by jax's splash attention: q [B,Hq,n,D], k/v [B,Hkv,n,D] (the keys of the
    same n tokens), q_pos [B,n] (-1 = padding); n a multiple of SPLASH_BLOCK. Causal by index, padding
    separated by segment ids: equal to `flash_attention` when `index_causal(q_pos)`. Returns out
    [B,Hq,n,D] and lse [B,Hq,n] float32 (zeros for padding queries). interpret: Pallas interpreter (CPU tests).
    """
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    sm, sk = _compat.splash_mask, _compat.splash_kernel
    one = sm.CausalMask((n, n)) if window is None else sm.LocalMask((n, n), window_size=(window - 1, 0), offset=0)
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([one] * G), save_residuals=True,
                                              attn_logits_soft_cap=softcap, interpret=interpret)
    segments = (q_pos >= 0).astype(jnp.int32)

    def group(qg, kh, vh, seg):  # [G,n,D], [n,D], [n,D], [n]: one KV head of one row
        out, (lse,) = kernel(qg, kh, vh, segment_ids=sk.SegmentIds(q=seg, kv=seg))
        return out, lse

    heads = jax.vmap(group, in_axes=(0, 0, 0, None))
    qs = (q * jnp.asarray(scale, q.dtype)).reshape(B, Hkv, G, n, D)
    out, lse = jax.vmap(heads)(qs, k.astype(q.dtype), v.astype(q.dtype), segments)
    real = (q_pos >= 0)[:, None, :]
    out = jnp.where(real[..., None], out.reshape(B, Hq, n, D), 0).astype(q.dtype)
    return out, jnp.where(real, lse.reshape(B, Hq, n).astype(jnp.float32), 0.0)
