"""Decode attention over quantized keys and values on TPU (Mosaic): the codes are dequantized in VMEM.

Grid (B, Hkv, key block [arbitrary]), as `decode_attention.pallas_tpu`: the G query heads of a KV group
form one block padded with zero rows to a sublane tile (8 rows for float32, 16 for bfloat16), an online
softmax (m, l, acc) lives in VMEM scratch, each step writes its raw float32 logits (scaled, soft-capped,
MASK_VALUE where not visible), the last step writes the output and a lane-dense lse. Key blocks without a
visible slot skip compute and their index map repeats the previous fetched block, so their bytes are
never copied from HBM.

Block layout (per grid step, bk slots; D = head_dim, per = codes per byte: 1 int8 / fp8, 2 int4, 4 int2):
  codes       [bk, D·bits/8] uint8 (packed int4 / int2, or the bits of fp8) or int8: the full last dim
              (legal whatever its width: D/4 = 16 bytes for int2 at head_dim 64; Mosaic pads the lanes
              of narrow rows in VMEM, not in HBM)
  token scale [bk, D/g] int16 (the bits of the float16 scales) and zero point [bk, D/g] int8: full last dim
  key scale   [bk/G, D] per channel over G slots: bk a multiple of 128 and of G, bk/G rows a multiple of
  per channel 32 (16 when symmetric: int8 / 16-bit tiles), or 8 for very large G
  query       [per, Gp, D/per] (split into the pieces in XLA: a few hundred bytes)
  visible     [1, bk] int32;  logits out [G, bk];  out [per, G, D/per] (joined in XLA);  lse [G, 128]
The last key block may run past the stored slots (S not a multiple of bk): Pallas pads it with unspecified
values, which the visibility mask drops (select, never multiply), so the codes are never padded or copied.

Dequantization, all in VMEM, per key block: the codes tile is widened to int32 once; piece i of head_dim
is ``(code >> bits·i) & mask`` (`kv_quant.pack` stores element j + i·D/per in those bits of byte j), so
the pieces sit at the same lanes as the bytes and need no lane movement. Each piece becomes
``code · scale + bias`` in float32 (exact: equal to `kv_quant.dequantize`), the scale and bias spread over
the piece's lanes from their [bk, D/g] columns (selects on the lane index when a piece spans several
groups), or, for per-channel keys, taken from the [bk/G, D] rows (an exact 0/1 matmul picks the piece's
lanes; a sublane broadcast repeats each row G times, an exact 0/1 matmul when G is not a multiple of 8).
The query piece is dotted with the key piece (s = Σ_i q_i·k_iᵀ) and the probabilities with each value
piece (acc_i += p·v_i), on the MXU: bfloat16 operands for a bfloat16 query (the dequantized rows rounded
to bfloat16), float32 at HIGHEST precision otherwise (the rotated queries of Hadamard configurations are
float32). Value rows of invisible slots are zeroed before P·V. Nothing dequantized ever goes to HBM.

Bytes read from HBM per slot, keys + values (`_unpack.bytes_per_slot`), head_dim 128, vs 2·D·2 = 512
for bfloat16:
  int8 / fp8, one scale per token:        2·(128 + 2)               = 260  (+1 per zero point)
  int4, groups of 32, asymmetric:         2·(64 + 4·2 + 4)           = 152
  int4 KIVI (keys per channel, G = 32):   (64 + 128·3/32) + (64 + 3) = 143
  int2, groups of 32, asymmetric:         2·(32 + 4·2 + 4)           = 88
plus 4 bytes of visibility per slot and G·4 bytes of logits written. The price is VPU work: about 4-6
vector ops per element to unpack and dequantize (more for fp8, decoded from its bits), so low-bit formats
may be compute-bound on chips with little VPU throughput per byte of HBM (unmeasured: never run on a TPU;
checked in interpret mode and by the lowering gate).

Supported: every configuration `KVQuant.check` accepts (int8, fp8, int4, int2; keys per token or per
channel; any group; symmetric or asymmetric; soft-capping). Nothing raises NotImplementedError here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import _compat
from kvjax._compat import pl
from kvjax.kernels import _common, _scores_tpu
from kvjax.kernels.decode_attention.pallas_tpu import _fetch_plan
from kvjax.kernels.quantized_attention import _unpack
from kvjax.kv_quant import KVQuant, Quantized

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
LANES = 128


def _dequant_pieces(codes_ref, scale_ref, zero_ref, lay: _unpack.Layout, channel: bool) -> list[jax.Array]:
    """The float32 pieces [bk, D/per] of a block of stored rows."""
    pieces = _unpack.code_pieces(codes_ref[...], lay)
    sc, bias = _unpack.scale_and_bias(scale_ref[...], None if zero_ref is None else zero_ref[...], lay)
    out = []
    for p, c in enumerate(pieces):
        if channel:
            sp = _unpack.repeat_rows(_unpack.channel_piece(sc, p, lay), lay.slot_group)
            bp = None if bias is None else _unpack.repeat_rows(_unpack.channel_piece(bias, p, lay), lay.slot_group)
        else:
            sp = _unpack.token_piece(sc, p, lay)
            bp = None if bias is None else _unpack.token_piece(bias, p, lay)
        x = c * sp
        out.append(x if bp is None else x + bp)
    return out


def _kernel(src_ref, has_ref, *refs, scale, softcap, hkv, nk, groups, lay, kz, vz, cdt, precision):
    it = iter(refs)
    q_ref, kc_ref, ks_ref = next(it), next(it), next(it)
    kz_ref = next(it) if kz else None
    vc_ref, vs_ref = next(it), next(it)
    vz_ref = next(it) if vz else None
    vis_ref, o_ref, logits_ref, lse_ref, m_ref, l_ref, acc_ref = it
    b, h, ki = (pl.program_id(i) for i in range(3))

    @pl.when(ki == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _common.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    has_visible = has_ref[(b * hkv + h) * nk + ki] > 0

    @pl.when(has_visible)
    def _step():
        vrow = vis_ref[...] > 0  # [1, bk]
        s = None
        for p, kp in enumerate(_dequant_pieces(kc_ref, ks_ref, kz_ref, lay, lay.key_channel)):
            d = lax.dot_general(q_ref[p], kp.astype(cdt), _NT, precision=precision,
                                preferred_element_type=jnp.float32)
            s = d if s is None else s + d
        s = s * scale  # [Gp, bk]; rows >= G are zero-query padding
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(vrow, s, _common.MASK_VALUE)
        logits_ref[...] = s[:groups]
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [Gp, 128]
        e = jnp.where(vrow, jnp.exp(s - m_new[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(e, axis=1, keepdims=True)
        m_ref[...] = m_new
        vcol = _scores_tpu._key_column(vis_ref[...]) > 0  # [bk, 1]
        e = e.astype(cdt)
        for p, vp in enumerate(_dequant_pieces(vc_ref, vs_ref, vz_ref, lay, False)):
            vp = jnp.where(vcol, vp, 0.0).astype(cdt)  # garbage (even NaN) in invisible slots never leaks
            pv = lax.dot_general(e, vp, _NN, precision=precision, preferred_element_type=jnp.float32)
            acc_ref[p] = acc_ref[p] * alpha[:, :1] + pv

    @pl.when(jnp.logical_not(has_visible))
    def _skip():
        logits_ref[...] = jnp.full(logits_ref.shape, _common.MASK_VALUE, jnp.float32)

    @pl.when(ki == nk - 1)
    def _finish():
        l = l_ref[...]
        inv = jnp.where(l > 0, 1.0 / jnp.maximum(l, 1e-37), 0.0)[:groups, :1]
        for p in range(lay.per):
            o_ref[p] = acc_ref[p][:groups] * inv
        lse = jnp.where(l > 0, m_ref[...] + jnp.log(jnp.maximum(l, 1e-37)), _common.MASK_VALUE)
        lse_ref[...] = lse[:groups]


def plan_blocks(lay: _unpack.Layout, s: int, asymmetric: bool, block_k: int) -> tuple[int, int]:
    """(bk, rows of per-channel key scales per block): bk a multiple of 128 (and of G with per-channel
    keys, with bk/G rows a multiple of the int8 / 16-bit sublane tile, or of 8 for very large G)."""
    unit = LANES
    rows_align = 32 if asymmetric else 16
    if lay.key_channel:
        unit = _unpack.lcm(LANES, lay.slot_group * rows_align)
        if unit > 4096:
            unit = _unpack.lcm(LANES, lay.slot_group * 8)
    bk = max(unit, block_k // unit * unit)
    bk = min(bk, _common.round_up(s, unit))
    return bk, (bk // lay.slot_group if lay.key_channel else bk)


def quantized_decode_attention(query: jax.Array, k: Quantized, v: Quantized, visible: jax.Array, *, scale: float,
                               config: KVQuant, softcap: float | None = None, interpret=False, block_k: int = 512
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """query [B,Hq,D]; k, v quantized over [B,Hkv,S',...]; visible [B,Hkv,S] (S <= S') ->
    (out [B,Hq,D] f32, lse [B,Hq] f32 (MASK_VALUE where a head sees nothing), logits [B,Hkv,G,S] f32)."""
    b, hq, d = query.shape
    hkv, s = visible.shape[1:]
    g = hq // hkv
    lay = _unpack.layout(config, d)
    bk, rows = plan_blocks(lay, s, config.asymmetric, block_k)
    nk = pl.cdiv(s, bk)
    cdt = jnp.promote_types(query.dtype, jnp.bfloat16)  # float32 stays float32; float16 -> float32
    gp = _common.round_up(g, 8 * max(1, 4 // jnp.dtype(cdt).itemsize))
    q = query.reshape(b, hkv, g, lay.per, lay.piece).transpose(0, 1, 3, 2, 4).astype(cdt)
    q = _common.pad_axis(q, 3, gp)  # [B,Hkv,per,Gp,D/per]
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    vis = _common.pad_axis(visible.astype(jnp.int32), 2, nk * bk)
    src, has = _fetch_plan(vis, bk)
    if interpret is True:
        interpret = _compat.tpu_interpret_params()

    def kv_map(b_, h_, ki, src_, has_):
        return (b_, h_, src_[(b_ * hkv + h_) * nk + ki], 0)

    def slots(x: jax.Array, n: int) -> jax.Array:
        """x [B,Hkv,R,..] padded to one block of n rows when it holds fewer (small inputs only)."""
        return _common.pad_axis(x, 2, n) if x.shape[2] < n else x

    def stored(qz: Quantized, channel: bool) -> tuple[list[jax.Array], list]:
        arrays = [slots(_unpack.storage_bits(qz.codes), bk)]
        n = rows if channel else bk
        arrays.append(slots(_unpack.storage_scale(qz.scale), n))
        if qz.zero is not None:
            arrays.append(slots(qz.zero, n))
        specs = [pl.BlockSpec((None, None, bk, arrays[0].shape[-1]), kv_map)]
        specs += [pl.BlockSpec((None, None, n, a.shape[-1]), kv_map) for a in arrays[1:]]
        return arrays, specs

    k_arrays, k_specs = stored(k, lay.key_channel)
    v_arrays, v_specs = stored(v, False)
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, hkv=hkv, nk=nk, groups=g, lay=lay,
                               kz=k.zero is not None, vz=v.zero is not None, cdt=cdt, precision=precision)
    out, logits, lse = pl.pallas_call(
        kernel,
        grid_spec=_compat.prefetch_scalar_grid_spec(
            num_scalar_prefetch=2,
            grid=(b, hkv, nk),
            in_specs=[pl.BlockSpec((None, None, lay.per, gp, lay.piece), lambda b_, h_, ki, *_: (b_, h_, 0, 0, 0)),
                      *k_specs, *v_specs,
                      pl.BlockSpec((None, None, 1, bk), lambda b_, h_, ki, *_: (b_, h_, 0, ki))],
            out_specs=[
                pl.BlockSpec((None, None, lay.per, g, lay.piece), lambda b_, h_, ki, *_: (b_, h_, 0, 0, 0)),
                pl.BlockSpec((None, None, g, bk), lambda b_, h_, ki, *_: (b_, h_, 0, ki)),
                pl.BlockSpec((None, None, g, LANES), lambda b_, h_, ki, *_: (b_, h_, 0, 0)),
            ],
            scratch_shapes=[_compat.vmem((gp, LANES), jnp.float32), _compat.vmem((gp, LANES), jnp.float32),
                            _compat.vmem((lay.per, gp, lay.piece), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, lay.per, g, lay.piece), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, g, max(s, bk)), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, g, LANES), jnp.float32),
        ],
        compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kvjax_quantized_decode_attention",
    )(src, has, q, *k_arrays, *v_arrays, vis[:, :, None, :])
    out = out.transpose(0, 1, 3, 2, 4).reshape(b, hq, d)
    return out, lse[..., 0].reshape(b, hq), logits[..., :s]
