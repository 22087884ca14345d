"""Mosaic TPU kernels shared by window scores and column mass.

Both ops need, for every key j, reductions over queries i of p[i,j] = exp(s[i,j] - lse_i) with
s = scale * q_i . k_j under the causal position mask. Two passes, neither of which writes a
[queries x keys] tensor to HBM:

1. ``lse`` pass, grid (B, Hkv, q block, k block [arbitrary]): online max / sum per query row.
2. ``moments`` pass, grid (B, Hkv, k block, q block [arbitrary]): recompute s, form p and
   accumulate per-key moments in VMEM; write them at the last q block (the dV kernel of flash
   attention's backward with dO replaced by ones).

Layout: logits are computed transposed, keys on sublanes and queries on lanes ([bk, bq], as the
splash-attention dKV kernel does), so per-query statistics (lse, query positions) are
lane-major rows [1, bq] read straight from HBM, and the per-key result leaves as a lane-dense
row [1, bk] after one aligned transpose per key block. Key positions are turned into a column
[bk, 1] by an aligned (128, bk) transpose.

Block pairs that hold no visible pair (min key position > max query position) skip compute,
and their index maps are clamped so that the skipped blocks are never fetched either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import _compat
from kvjax._compat import pl
from kvjax.kernels import _common

_NT = (((1,), (1,)), ((), ()))  # contract the last dims of both operands (A @ B.T)
LANES = 128


def _precision(dtype) -> lax.Precision | None:
    # f32 operands would otherwise be rounded to bf16 by the MXU.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _key_column(kpos_row: jax.Array) -> jax.Array:
    """[1, bk] int32 key positions -> [bk, 1] float32 (exact below 2**24)."""
    row = kpos_row.astype(jnp.float32)
    return jnp.broadcast_to(row, (LANES, row.shape[1])).T[:, :1]


def _lane_fold(x: jax.Array) -> jax.Array:
    """[bk, bq] -> [bk, 128]: sums the 128-lane chunks (bq is a multiple of 128)."""
    out = x[:, :LANES]
    for c in range(1, x.shape[1] // LANES):
        out = out + x[:, c * LANES:(c + 1) * LANES]
    return out


def _lse_kernel(kmin_ref, qmax_ref, lastk_ref, q_ref, k_ref, qpos_ref, kpos_ref, lse_ref,
                m_ref, l_ref, *, scale, groups, hkv, nk, precision):
    b, h, qi, ki = (pl.program_id(i) for i in range(4))

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _common.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    run = kmin_ref[(b * hkv + h) * nk + ki] <= qmax_ref[b * pl.num_programs(2) + qi]

    @pl.when(run)
    def _step():
        kcol = _key_column(kpos_ref[...])
        qrow = qpos_ref[...].astype(jnp.float32)
        mask = (kcol >= 0) & (kcol <= qrow)  # [bk, bq]
        k = k_ref[...]
        for g in range(groups):
            s = lax.dot_general(k, q_ref[g], _NT, precision=precision,
                                preferred_element_type=jnp.float32) * scale
            s = jnp.where(mask, s, _common.MASK_VALUE)
            m_prev = m_ref[g]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
            e = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            l_ref[g] = l_ref[g] * jnp.exp(m_prev - m_new) + jnp.sum(e, axis=0, keepdims=True)
            m_ref[g] = m_new

    @pl.when(ki == nk - 1)
    def _finish():
        for g in range(groups):
            l = l_ref[g]
            lse_ref[g] = jnp.where(l > 0, m_ref[g] + jnp.log(jnp.maximum(l, 1e-37)), 0.0)


def _moments_kernel(kmin_ref, qmax_ref, firstq_ref, q_ref, k_ref, qpos_ref, kpos_ref, lse_ref, *rest,
                    scale, groups, hkv, nq, moments, group_reduce, precision):
    n_out = len(moments)
    out_refs, acc_ref = rest[:n_out], rest[n_out]
    per_member = group_reduce in (None, "max")
    slots = groups if per_member else 1
    b, h, ki, qi = (pl.program_id(i) for i in range(4))

    @pl.when(qi == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    run = kmin_ref[(b * hkv + h) * pl.num_programs(2) + ki] <= qmax_ref[b * nq + qi]

    @pl.when(run)
    def _step():
        kcol = _key_column(kpos_ref[...])
        qrow = qpos_ref[...].astype(jnp.float32)
        mask = (kcol >= 0) & (kcol <= qrow)  # [bk, bq]
        k = k_ref[...]
        for g in range(groups):
            s = lax.dot_general(k, q_ref[g], _NT, precision=precision,
                                preferred_element_type=jnp.float32) * scale
            p = jnp.where(mask, jnp.exp(s - lse_ref[g]), 0.0)
            for mi, moment in enumerate(moments):
                slot = mi * slots + (g if per_member else 0)
                acc_ref[slot] = acc_ref[slot] + _lane_fold(_common.moment_contribution(moment, p))

    @pl.when(qi == nq - 1)
    def _finish():
        for mi in range(n_out):
            rows = [jnp.sum(acc_ref[mi * slots + a].T, axis=0, keepdims=True) for a in range(slots)]
            out = out_refs[mi]
            if group_reduce is None:
                for a, row in enumerate(rows):
                    out[a:a + 1, :] = row
            else:  # "max" keeps one row per member; "sum" / "mean" summed them into one
                out[...] = _common.combine_group_rows(rows, group_reduce, groups)


def _prepare(q5, keys, qpos, kpos, lse, bq, bk):
    """Pads T to a multiple of bq and S to a multiple of bk (no copy when already aligned)."""
    t, s = q5.shape[3], keys.shape[2]
    tp, sp = _common.round_up(t, bq), _common.round_up(s, bk)
    q5 = _common.pad_axis(q5, 3, tp)
    qpos = _common.pad_axis(qpos.astype(jnp.int32), 1, tp, -1)
    keys = _common.pad_axis(keys, 2, sp)
    kpos = _common.pad_axis(kpos.astype(jnp.int32), 2, sp, -1)
    if lse is not None:
        lse = _common.pad_axis(lse, 4, tp)
    return q5, keys, qpos, kpos, lse


def blocks_for(t: int, s: int, block_q: int, block_k: int) -> tuple[int, int]:
    """TPU-legal block sizes: multiples of 128 (lane dims) dividing the padded lengths."""
    tp, sp = _common.round_up(t, LANES), _common.round_up(s, LANES)
    return _common.pick_block(tp, block_q, LANES), _common.pick_block(sp, block_k, LANES)


def score_moments(q5: jax.Array, keys: jax.Array, qpos: jax.Array, kpos: jax.Array, *, scale: float,
                  moments: tuple[str, ...], group_reduce: str | None, lse: jax.Array | None = None,
                  block_q: int = 256, block_k: int = 512, interpret=False) -> dict[str, jax.Array]:
    """Per-key moments of the causal softmax over the given queries.

    q5 [B,Hkv,G,T,D], keys [B,Hkv,S,D] (same dtype), qpos [B,T] int32 (-1 = padding query),
    kpos [B,Hkv,S] int32 (-1 = empty slot), lse optional [B,Hkv,G,1,T] float32.
    Returns moment -> [B,Hkv,S] float32, or [B,Hkv,G,S] when group_reduce is None.
    """
    b, hkv, groups, t, d = q5.shape
    s = keys.shape[2]
    slots = len(moments) * (groups if group_reduce in (None, "max") else 1)
    # Keep the VMEM accumulators (slots x bk x 128 float32) within about 2 MiB.
    block_k = min(block_k, max(LANES, (2 << 20) // (slots * LANES * 4)))
    bq, bk = blocks_for(t, s, block_q, block_k)
    t_pad, s_pad = _common.round_up(t, LANES), _common.round_up(s, LANES)
    q5, keys, qpos, kpos, lse = _prepare(q5, keys, qpos, kpos, lse, bq, bk)
    nq, nk = t_pad // bq, s_pad // bk
    run, qmax, kmin = _common.block_visibility(qpos, kpos, bq, bk)  # run [B,Hkv,nQ,nK]
    qmax, kmin = qmax.reshape(-1), kmin.reshape(-1)  # SMEM wants flat arrays
    kpos4 = kpos[:, :, None, :]
    qpos3 = qpos[:, None, :]
    precision = _precision(keys.dtype)
    if interpret is True:
        interpret = _compat.tpu_interpret_params()

    if lse is None:
        lastk = _common.last_visible_block(run).reshape(-1)

        def kv_block(b_, h_, qi, ki, kmin_, qmax_, lastk_):
            return jnp.minimum(ki, lastk_[(b_ * hkv + h_) * nq + qi])

        lse = pl.pallas_call(
            functools.partial(_lse_kernel, scale=scale, groups=groups, hkv=hkv, nk=nk, precision=precision),
            grid_spec=_compat.prefetch_scalar_grid_spec(
                num_scalar_prefetch=3,
                grid=(b, hkv, nq, nk),
                in_specs=[
                    pl.BlockSpec((None, None, groups, bq, d), lambda b_, h_, qi, ki, *_: (b_, h_, 0, qi, 0)),
                    pl.BlockSpec((None, None, bk, d),
                                 lambda b_, h_, qi, ki, *r: (b_, h_, kv_block(b_, h_, qi, ki, *r), 0)),
                    pl.BlockSpec((None, 1, bq), lambda b_, h_, qi, ki, *_: (b_, 0, qi)),
                    pl.BlockSpec((None, None, 1, bk),
                                 lambda b_, h_, qi, ki, *r: (b_, h_, 0, kv_block(b_, h_, qi, ki, *r))),
                ],
                out_specs=pl.BlockSpec((None, None, groups, 1, bq), lambda b_, h_, qi, ki, *_: (b_, h_, 0, 0, qi)),
                scratch_shapes=[_compat.vmem((groups, 1, bq), jnp.float32)] * 2,
            ),
            out_shape=jax.ShapeDtypeStruct((b, hkv, groups, 1, t_pad), jnp.float32),
            compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret,
            name="kvjax_score_lse",
        )(kmin, qmax, lastk, q5, keys, qpos3, kpos4)

    firstq = _common.first_visible_block(run).reshape(-1)

    def q_block(b_, h_, ki, qi, kmin_, qmax_, firstq_):
        return jnp.maximum(qi, firstq_[(b_ * hkv + h_) * nk + ki])

    rows = groups if group_reduce is None else 1
    outs = pl.pallas_call(
        functools.partial(_moments_kernel, scale=scale, groups=groups, hkv=hkv, nq=nq, moments=moments,
                          group_reduce=group_reduce, precision=precision),
        grid_spec=_compat.prefetch_scalar_grid_spec(
            num_scalar_prefetch=3,
            grid=(b, hkv, nk, nq),
            in_specs=[
                pl.BlockSpec((None, None, groups, bq, d),
                             lambda b_, h_, ki, qi, *r: (b_, h_, 0, q_block(b_, h_, ki, qi, *r), 0)),
                pl.BlockSpec((None, None, bk, d), lambda b_, h_, ki, qi, *_: (b_, h_, ki, 0)),
                pl.BlockSpec((None, 1, bq), lambda b_, h_, ki, qi, *r: (b_, 0, q_block(b_, h_, ki, qi, *r))),
                pl.BlockSpec((None, None, 1, bk), lambda b_, h_, ki, qi, *_: (b_, h_, 0, ki)),
                pl.BlockSpec((None, None, groups, 1, bq),
                             lambda b_, h_, ki, qi, *r: (b_, h_, 0, 0, q_block(b_, h_, ki, qi, *r))),
            ],
            out_specs=[pl.BlockSpec((None, None, rows, bk), lambda b_, h_, ki, qi, *_: (b_, h_, 0, ki))
                       for _ in moments],
            scratch_shapes=[_compat.vmem((slots, bk, LANES), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, hkv, rows, s_pad), jnp.float32) for _ in moments],
        compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kvjax_score_moments",
    )(kmin, qmax, firstq, q5, keys, qpos3, kpos4, lse)

    result = {}
    for moment, out in zip(moments, outs):
        out = out[..., :s]
        result[moment] = out if group_reduce is None else out[:, :, 0]
    return result
