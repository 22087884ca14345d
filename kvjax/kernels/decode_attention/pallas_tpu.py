"""Decode attention with probabilities on TPU (Mosaic).

Grid (B, Hkv, key block [arbitrary]); the G query heads of a KV group form one [G, D] block,
padded with zero rows to a full sublane tile (8 rows for f32, 16 for bf16).
Each step writes the block's raw float32 logits (masked to a large negative value) and updates
the online softmax (m, l, acc) in VMEM; the last step writes the output and a lane-dense lse.
XLA then fuses probs = exp(logits - lse) (jax_conventions.md §5.6): +G·4 bytes per slot of HBM
traffic beside the 2·D·itemsize of keys and values.

Empty key blocks skip compute, and their index map repeats the previous fetched block, so they
are never copied from HBM (MaxText ragged-attention trick). Value rows of invalid slots are
zeroed before P·V, so NaN or stale data in free slots cannot leak through 0 * NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import _compat
from kvjax._compat import pl
from kvjax.kernels import _common, _scores_tpu

_NT = (((1,), (1,)), ((), ()))
LANES = 128


def _kernel(src_ref, any_ref, q_ref, k_ref, v_ref, valid_ref, o_ref, logits_ref, lse_ref,
            m_ref, l_ref, acc_ref, *, scale, hkv, nk, groups, cdt, precision):
    b, h, ki = (pl.program_id(i) for i in range(3))

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _common.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    has_valid = any_ref[(b * hkv + h) * nk + ki] > 0

    @pl.when(has_valid)
    def _step():
        vrow = valid_ref[...] > 0  # [1, bk]
        q = q_ref[...].astype(cdt)
        s = lax.dot_general(q, k_ref[...].astype(cdt), _NT, precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [G, bk]
        s = jnp.where(vrow, s, _common.MASK_VALUE)  # [Gp, bk]; rows >= G are zero-query padding
        logits_ref[...] = s[:groups]
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [G, 128]
        p = jnp.where(vrow, jnp.exp(s - m_new[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        vcol = _scores_tpu._key_column(valid_ref[...]) > 0  # [bk, 1]
        # Select in float32: v5e's VPU has no bf16 arithmetic.
        v = jnp.where(vcol, v_ref[...].astype(jnp.float32), 0.0).astype(cdt)
        pv = lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv
        m_ref[...] = m_new

    @pl.when(jnp.logical_not(has_valid))
    def _skip():
        logits_ref[...] = jnp.full(logits_ref.shape, _common.MASK_VALUE, jnp.float32)

    @pl.when(ki == nk - 1)
    def _finish():
        l = l_ref[...]
        inv = jnp.where(l > 0, 1.0 / jnp.maximum(l, 1e-37), 0.0)
        o_ref[...] = (acc_ref[...] * inv[:, :1])[:groups].astype(o_ref.dtype)
        lse = jnp.where(l > 0, m_ref[...] + jnp.log(jnp.maximum(l, 1e-37)), 0.0)
        lse_ref[...] = lse[:groups]


def _fetch_plan(valid_i32: jax.Array, bk: int) -> tuple[jax.Array, jax.Array]:
    """Per key block: whether it holds a valid slot, and which block to fetch for it.

    An empty block re-uses the index of the previous non-empty one (the first non-empty one for
    leading empties), so the pipeline skips its copy.
    """
    b, hkv, sp = valid_i32.shape
    nk = sp // bk
    has = jnp.max(valid_i32.reshape(b, hkv, nk, bk), axis=-1)
    idx = jnp.arange(nk, dtype=jnp.int32)
    prev = lax.cummax(jnp.where(has > 0, idx, -1), axis=2)
    first = jnp.min(jnp.where(has > 0, idx, nk - 1), axis=2, keepdims=True)
    src = jnp.where(prev >= 0, prev, first)
    return src.reshape(-1).astype(jnp.int32), has.reshape(-1).astype(jnp.int32)


def decode_attention(query: jax.Array, keys: jax.Array, values: jax.Array, valid: jax.Array, *,
                     scale: float, interpret=False, block_k: int = 512) -> tuple[jax.Array, jax.Array]:
    """query [B,Hq,D], keys/values [B,Hkv,S,D], valid [B,Hkv,S] -> (out [B,Hq,D], probs [B,Hkv,G,S])."""
    b, hq, d = query.shape
    _, hkv, s, _ = keys.shape
    g = hq // hkv
    # Blocks of block_k slots whatever S: the last one may overhang the cache (Pallas pads its read with
    # unspecified values, masked here by `valid`), so keys and values are never copied to a padded length.
    bk = min(_common.round_up(block_k, LANES), _common.round_up(s, LANES))
    nk = pl.cdiv(s, bk)
    sp = nk * bk
    valid_i32 = _common.pad_axis(valid.astype(jnp.int32), 2, sp)
    src, has = _fetch_plan(valid_i32, bk)
    cdt = jnp.promote_types(query.dtype, keys.dtype)
    # The group is below a sublane tile (e.g. 4 < 8); pad the query rows to a full tile.
    gp = _common.round_up(g, 8 * max(1, 4 // jnp.dtype(cdt).itemsize))
    q = _common.pad_axis(query.reshape(b, hkv, g, d), 2, gp)
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    if interpret is True:
        interpret = _compat.tpu_interpret_params()

    def kv_map(b_, h_, ki, src_, any_):
        return (b_, h_, src_[(b_ * hkv + h_) * nk + ki], 0)

    out, logits, lse = pl.pallas_call(
        functools.partial(_kernel, scale=scale, hkv=hkv, nk=nk, groups=g, cdt=cdt, precision=precision),
        grid_spec=_compat.prefetch_scalar_grid_spec(
            num_scalar_prefetch=2,
            grid=(b, hkv, nk),
            in_specs=[
                pl.BlockSpec((None, None, gp, d), lambda b_, h_, ki, *_: (b_, h_, 0, 0)),
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, 1, bk), lambda b_, h_, ki, *_: (b_, h_, 0, ki)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, g, d), lambda b_, h_, ki, *_: (b_, h_, 0, 0)),
                pl.BlockSpec((None, None, g, bk), lambda b_, h_, ki, *_: (b_, h_, 0, ki)),
                pl.BlockSpec((None, None, g, LANES), lambda b_, h_, ki, *_: (b_, h_, 0, 0)),
            ],
            scratch_shapes=[_compat.vmem((gp, LANES), jnp.float32), _compat.vmem((gp, LANES), jnp.float32),
                            _compat.vmem((gp, d), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, g, d), query.dtype),
            jax.ShapeDtypeStruct((b, hkv, g, sp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, g, LANES), jnp.float32),
        ],
        compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kvjax_decode_attention",
    )(src, has, q, keys, values, valid_i32[:, :, None, :])
    probs = probs_from_logits(logits[..., :s], lse[..., :1], valid)
    return out.reshape(b, hq, d), probs


def probs_from_logits(logits: jax.Array, lse: jax.Array, valid: jax.Array) -> jax.Array:
    """[B,Hkv,G,S] logits, [B,Hkv,G,1] lse, [B,Hkv,S] valid -> float32 probabilities (XLA-fused)."""
    return jnp.where(valid[:, :, None, :], jnp.exp(logits - lse), 0.0)
