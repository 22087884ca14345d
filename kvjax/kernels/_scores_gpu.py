"""Pallas Triton (GPU) kernels shared by window scores and column mass.

Same two passes as ``_scores_tpu`` in the natural GPU layout (queries on rows, keys on columns):

1. ``lse``: one program per (batch, query head, query block) loops over the key blocks it can see.
2. ``moments``: one program per (batch, KV head, key block) loops over the group and the query
   blocks that can see it, summing p over rows into per-key accumulators held in registers.

Triton needs power-of-two shapes for every value: D is zero-padded to a power of two (>= 16,
which leaves q.k unchanged) and blocks are powers of two. Float32 inputs dot at IEEE precision
(``full_precision``; Triton's default is TF32). Run on an H200 (eval/device/nvidia-h200.md): column
mass 6.6-7.4x faster than XLA, window scores 2-4x slower (XLA stays their GPU default).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import _compat
from kvjax._compat import pl
from kvjax.kernels import _common


def full_precision(dtype: jnp.dtype) -> lax.Precision | None:
    """The dot precision of float32 inputs: IEEE. Triton's default for float32 dots is TF32 (10-bit
    mantissas), which the H200 run of the float32 kernel tests caught (errors near 1e-3); bfloat16 and
    float16 inputs are exact in either."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _lse_kernel(q_ref, k_ref, qpos_ref, kpos_ref, nblk_ref, lse_ref, *, scale, bk, precision):
    q = q_ref[...]
    qp = qpos_ref[...]
    bq = q.shape[0]

    def body(c, carry):
        m, l = carry
        k = k_ref[pl.ds(c * bk, bk), :]
        kp = kpos_ref[pl.ds(c * bk, bk)]
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
        mask = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
        s = jnp.where(mask, s, _common.MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        e = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        return m_new, l * jnp.exp(m - m_new) + jnp.sum(e, axis=1)

    init = (jnp.full((bq,), _common.MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    m, l = lax.fori_loop(0, nblk_ref[()], body, init)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-37)), 0.0)


def _moments_kernel(q_ref, k_ref, qpos_ref, kpos_ref, lse_ref, firstq_ref, *out_refs, scale, bq, nq,
                    groups, moments, group_reduce, precision):
    k = k_ref[...]
    kp = kpos_ref[...]
    bk = k.shape[0]
    per_member = []
    for g in range(groups):
        def body(c, accs, g=g):
            q = q_ref[g, pl.ds(c * bq, bq), :]
            lse = lse_ref[g, pl.ds(c * bq, bq)]
            qp = qpos_ref[pl.ds(c * bq, bq)]
            s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
            mask = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
            p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
            return tuple(a + jnp.sum(_common.moment_contribution(m, p), axis=0) for a, m in zip(accs, moments))

        init = tuple(jnp.zeros((bk,), jnp.float32) for _ in moments)
        per_member.append(lax.fori_loop(firstq_ref[()], nq, body, init))
    for mi in range(len(moments)):
        rows = [acc[mi] for acc in per_member]
        if group_reduce is None:
            for g, row in enumerate(rows):
                out_refs[mi * groups + g][...] = row
            continue
        out_refs[mi][...] = _common.combine_group_rows(rows, group_reduce, groups)


def score_moments(q5: jax.Array, keys: jax.Array, qpos: jax.Array, kpos: jax.Array, *, scale: float,
                  moments: tuple[str, ...], group_reduce: str | None, lse: jax.Array | None = None,
                  block_q: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 2,
                  interpret: bool = False) -> dict[str, jax.Array]:
    """Same contract as ``_scores_tpu.score_moments`` (lse, if given, is [B,Hkv,G,1,T]).

    ``interpret=True`` runs the Triton kernels in the generic Pallas interpreter (CPU tests).
    """
    b, hkv, groups, t, d = q5.shape
    s = keys.shape[2]
    bq = min(pow2_at_least(block_q), pow2_at_least(t))
    bk = min(pow2_at_least(block_k), pow2_at_least(s))
    dp = pow2_at_least(d)
    tp, sp = _common.round_up(t, bq), _common.round_up(s, bk)
    nq, nk = tp // bq, sp // bk
    q5 = _common.pad_axis(_common.pad_axis(q5, 4, dp), 3, tp)
    keys = _common.pad_axis(_common.pad_axis(keys, 3, dp), 2, sp)
    qpos = _common.pad_axis(qpos.astype(jnp.int32), 1, tp, -1)
    kpos = _common.pad_axis(kpos.astype(jnp.int32), 2, sp, -1)
    run, _, _ = _common.block_visibility(qpos, kpos, bq, bk)
    params = _compat.triton_compiler_params(num_warps, num_stages)
    precision = full_precision(q5.dtype)
    q_flat = q5.reshape(b * hkv, groups, tp, dp)
    k_flat = keys.reshape(b * hkv, sp, dp)
    kpos_flat = kpos.reshape(b * hkv, sp)

    if lse is None:
        nblk = (_common.last_visible_block(run) + 1).reshape(b * hkv, nq)
        lse = pl.pallas_call(
            functools.partial(_lse_kernel, scale=scale, bk=bk, precision=precision),
            grid=(b * hkv * groups, nq),
            in_specs=[
                pl.BlockSpec((None, bq, dp), lambda i, j: (i, j, 0)),
                pl.BlockSpec((None, sp, dp), lambda i, j: (i // groups, 0, 0)),
                pl.BlockSpec((None, bq), lambda i, j: (i // (hkv * groups), j)),
                pl.BlockSpec((None, sp), lambda i, j: (i // groups, 0)),
                pl.BlockSpec((None, None), lambda i, j: (i // groups, j)),
            ],
            out_specs=pl.BlockSpec((None, bq), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((b * hkv * groups, tp), jnp.float32),
            compiler_params=params,
            interpret=interpret,
            name="kvjax_score_lse_gpu",
        )(q_flat.reshape(b * hkv * groups, tp, dp), k_flat, qpos, kpos_flat, nblk)
        lse = lse.reshape(b * hkv, groups, tp)
    else:
        lse = _common.pad_axis(lse.reshape(b * hkv, groups, t), 2, tp)

    firstq = _common.first_visible_block(run).reshape(b * hkv, nk)
    n_rows = groups if group_reduce is None else 1
    outs = pl.pallas_call(
        functools.partial(_moments_kernel, scale=scale, bq=bq, nq=nq, groups=groups, moments=moments,
                          group_reduce=group_reduce, precision=precision),
        grid=(b * hkv, nk),
        in_specs=[
            pl.BlockSpec((None, groups, tp, dp), lambda i, j: (i, 0, 0, 0)),
            pl.BlockSpec((None, bk, dp), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, tp), lambda i, j: (i // hkv, 0)),
            pl.BlockSpec((None, bk), lambda i, j: (i, j)),
            pl.BlockSpec((None, groups, tp), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, None), lambda i, j: (i, j)),
        ],
        out_specs=[pl.BlockSpec((None, bk), lambda i, j: (i, j)) for _ in range(len(moments) * n_rows)],
        out_shape=[jax.ShapeDtypeStruct((b * hkv, sp), jnp.float32) for _ in range(len(moments) * n_rows)],
        compiler_params=params,
        interpret=interpret,
        name="kvjax_score_moments_gpu",
    )(q_flat, k_flat, qpos, kpos_flat, lse, firstq)

    result = {}
    for mi, moment in enumerate(moments):
        rows = [o.reshape(b, hkv, sp)[..., :s] for o in outs[mi * n_rows:(mi + 1) * n_rows]]
        result[moment] = jnp.stack(rows, axis=2) if group_reduce is None else rows[0]
    return result
