"""Decode attention over quantized keys and values on GPU (Pallas Triton): codes dequantized in registers.

Grid (B·Hkv, splits), as `decode_attention.pallas_gpu`: each program owns a contiguous range of key
blocks of bk slots (a power of two, a multiple of the key slot group G for per-channel keys), loops over
them with an online softmax, writes the raw logits and its partial (acc, m, l); XLA merges the splits by
log-sum-exp. The G query heads of a group are padded to >= 16 rows (the smallest Triton dot).

Block layout (per loop step; D = head_dim, per = codes per byte: 1 int8 / fp8, 2 int4, 4 int2):
  codes        [bk, D·bits/8] uint8 / int8 / float8_e4m3fn, loaded with a mask: visible slots only
  token scale  [bk, n] float16 (+ int8 zero points): the n = (D/per)/g groups of a piece, spread over
               its channels by a broadcast + reshape ([bk, n, g] -> [bk, D/per])
  key scale    [bk/G, D/per] per channel over G slots, one row per G slots (broadcast to [bk/G, G, D/per])
  query        [per, Gp, D/per]; out partials [per, Gp, D/per] (joined in XLA)
Logits are written [Gp, blocks·bk] and sliced to [G, S] by XLA (as decode_attention's GPU kernel).
The whole cache of a (row, KV head) is one ref; loads are masked by visibility, so the bytes of evicted
and empty slots are never read (predicated loads), the last block may run past the stored slots and
nothing is padded or copied. Invisible rows load as 0 and are dropped by the masks (select).

Dequantization: piece i of head_dim is ``(code >> bits·i) & mask`` (`kv_quant.pack` keeps element
j + i·D/per in byte j), a contiguous block of channels, so each query piece is dotted with its key piece
(s = Σ_i q_i·k_iᵀ) and the probabilities with each value piece; ``code · scale + bias`` with
``bias = (offset - zero) · scale`` per group, exact in float32. fp8 codes convert natively (sm_89+;
decoded from their bits on older GPUs). float32 queries dot at full IEEE precision, bfloat16 queries in
bfloat16.

Bytes read per slot: as the TPU kernel (`_unpack.bytes_per_slot`: 152 for int4 groups of 32 asymmetric at
head_dim 128, 88 for int2, 260 for int8, vs 512 for bfloat16), only for visible slots.

Falls back (NotImplementedError): Triton needs power-of-two tiles, so D/per, the per-token groups per
piece and the key slot group G must be powers of two, and D/per >= 16 (the smallest dot). head_dim 64
and 128 with every `KVQuant` preset qualify. Never run on a GPU in this project so far; checked in the
Pallas interpreter and by lowering for "cuda".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvjax import _compat
from kvjax._compat import pl
from kvjax.kernels import _common
from kvjax.kernels._scores_gpu import pow2_at_least
from kvjax.kernels.quantized_attention import _unpack
from kvjax.kv_quant import KVQuant, Quantized


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_supported(lay: _unpack.Layout) -> None:
    """`_unpack.Unsupported` (a NotImplementedError, with the reason) for a layout this Triton kernel cannot tile."""
    if not _pow2(lay.piece) or lay.piece < 16:
        raise _unpack.Unsupported(f"quantized decode on GPU (Triton) needs head_dim / {lay.per} = {lay.piece} a power "
                                  "of two >= 16 (Triton tiles and the smallest dot)")
    if not _pow2(lay.group):
        raise _unpack.Unsupported(f"quantized decode on GPU (Triton) needs a power-of-two scale group, got {lay.group}")
    if lay.key_channel and not _pow2(lay.slot_group):
        raise _unpack.Unsupported(f"quantized decode on GPU (Triton) needs a power-of-two key slot group, got "
                                  f"{lay.slot_group}")


def native_fp8() -> bool:
    """Whether float8_e4m3fn converts natively (sm_89+, or lowering from a host without a GPU)."""
    if jax.default_backend() != "gpu":
        return True
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is None or float(cc) >= 8.9
    except (TypeError, ValueError):
        return True


def _load(ref, mask):
    """Masked load; masked-off elements are 0 (unspecified for float8, which Triton cannot fill from an int;
    every use of them is dropped by a select)."""
    other = None if jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(ref.dtype, jnp.floating) else 0
    return _compat.pltriton.load(ref, mask=mask, other=other)


def _pieces(codes_ref, scale_ref, zero_ref, start, vis, lay: _unpack.Layout, channel: bool, nslots: int, bk: int,
            fp8_native: bool) -> list[jax.Array]:
    """float32 pieces [bk, D/per] of the rows start .. start + bk (0 where not visible)."""
    raw = _load(codes_ref.at[pl.ds(start, bk), :], vis[:, None])
    pieces = _unpack.code_pieces(raw, lay, native_fp8=fp8_native)
    out = []
    for p, c in enumerate(pieces):
        if channel:
            r, grp = bk // lay.slot_group, lay.slot_group
            row0 = start // grp
            rmask = (row0 + jnp.arange(r)) < nslots // grp
            cols = pl.ds(p * lay.piece, lay.piece)
            sc = _load(scale_ref.at[pl.ds(row0, r), cols], rmask[:, None])
            zr = None if zero_ref is None else _load(zero_ref.at[pl.ds(row0, r), cols], rmask[:, None])
            sc, bias = _unpack.scale_and_bias(sc, zr, lay)
            rep = lambda x: jnp.broadcast_to(x[:, None, :], (r, grp, lay.piece)).reshape(bk, lay.piece)  # noqa: E731
            sc = rep(sc)
            bias = None if bias is None else rep(bias)
        else:
            first = p * lay.piece // lay.group
            n = max(1, lay.piece // lay.group)  # groups in the piece (a group may also span pieces)
            cols = pl.ds(first, n)
            sc = _load(scale_ref.at[pl.ds(start, bk), cols], vis[:, None])
            zr = None if zero_ref is None else _load(zero_ref.at[pl.ds(start, bk), cols], vis[:, None])
            sc, bias = _unpack.scale_and_bias(sc, zr, lay)
            if n > 1:
                def spread(x):
                    return jnp.broadcast_to(x[:, :, None], (bk, n, lay.group)).reshape(bk, lay.piece)

                sc = spread(sc)
                bias = None if bias is None else spread(bias)
        x = c * sc
        out.append(x if bias is None else x + bias)
    return out


def _kernel(*refs, scale, softcap, bk, bps, nblocks, nslots, lay, kz, vz, cdt, precision, fp8_native):
    it = iter(refs)
    q_ref, kc_ref, ks_ref = next(it), next(it), next(it)
    kz_ref = next(it) if kz else None
    vc_ref, vs_ref = next(it), next(it)
    vz_ref = next(it) if vz else None
    vis_ref, logits_ref, acc_ref, m_ref, l_ref = it
    rows = q_ref.shape[1]
    qs = [q_ref[p] for p in range(lay.per)]
    first = pl.program_id(1) * bps
    last = jnp.minimum(first + bps, nblocks)

    def body(c, carry):
        *acc, m, l = carry
        start = c * bk
        vm = vis_ref[pl.ds(start, bk)] > 0
        s = None
        for q, kp in zip(qs, _pieces(kc_ref, ks_ref, kz_ref, start, vm, lay, lay.key_channel, nslots, bk, fp8_native)):
            d = jnp.dot(q, kp.astype(cdt).T, precision=precision, preferred_element_type=jnp.float32)
            s = d if s is None else s + d
        s = s * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(vm[None, :], s, _common.MASK_VALUE)
        logits_ref[:, pl.ds(start, bk)] = s
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        e = jnp.where(vm[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pe = e.astype(cdt)
        new_acc = []
        for a, vp in zip(acc, _pieces(vc_ref, vs_ref, vz_ref, start, vm, lay, False, nslots, bk, fp8_native)):
            vp = jnp.where(vm[:, None], vp, 0.0).astype(cdt)
            new_acc.append(a * alpha[:, None] + jnp.dot(pe, vp, precision=precision,
                                                        preferred_element_type=jnp.float32))
        return (*new_acc, m_new, l * alpha + jnp.sum(e, axis=1))

    init = tuple(jnp.zeros((rows, lay.piece), jnp.float32) for _ in range(lay.per)) + (
        jnp.full((rows,), _common.MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
    *acc, m, l = lax.fori_loop(first, last, body, init)
    for p in range(lay.per):
        acc_ref[p] = acc[p]
    m_ref[...] = m
    l_ref[...] = l


def _plan(s: int, bh: int, block_k: int, target_programs: int, unit: int) -> tuple[int, int, int, int]:
    """(bk, blocks, blocks per split, splits): bk a power of two >= unit."""
    bk = max(pow2_at_least(block_k), unit)
    while bk > max(16, unit) and bk // 2 >= s:
        bk //= 2
    blocks = pl.cdiv(s, bk)
    want = max(1, min(blocks, -(-target_programs // bh)))
    bps = pl.cdiv(blocks, want)
    return bk, blocks, bps, pl.cdiv(blocks, bps)


def quantized_decode_attention(query: jax.Array, k: Quantized, v: Quantized, visible: jax.Array, *, scale: float,
                               config: KVQuant, softcap: float | None = None, interpret: bool = False,
                               block_k: int = 64, target_programs: int = 256, num_warps: int = 4,
                               num_stages: int = 2, fp8_native: bool | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """query [B,Hq,D]; k, v quantized over [B,Hkv,S',...]; visible [B,Hkv,S] (S <= S') ->
    (out [B,Hq,D] f32, lse [B,Hq] f32 (MASK_VALUE where a head sees nothing), logits [B,Hkv,G,S] f32).
    fp8_native: convert float8 codes natively (None: when the GPU has sm_89+), else decode their bits."""
    b, hq, d = query.shape
    hkv, s = visible.shape[1:]
    g = hq // hkv
    lay = _unpack.layout(config, d)
    check_supported(lay)
    bh = b * hkv
    nslots = k.codes.shape[2]
    gp = max(16, pow2_at_least(g))
    bk, nblocks, bps, splits = _plan(s, bh, block_k, target_programs, lay.slot_group if lay.key_channel else 16)
    sv = nblocks * bk
    cdt = jnp.promote_types(query.dtype, jnp.bfloat16)
    precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
    q = query.reshape(bh, g, lay.per, lay.piece).transpose(0, 2, 1, 3).astype(cdt)
    q = _common.pad_axis(q, 2, gp)  # [BH, per, Gp, D/per]
    vis = _common.pad_axis(visible.reshape(bh, s).astype(jnp.int32), 1, sv)
    fp8_native = native_fp8() if fp8_native is None else fp8_native

    def flat(x: jax.Array, native: bool = False) -> jax.Array:
        if not native and x.dtype == jnp.float8_e4m3fn:
            x = _unpack.storage_bits(x)
        return x.reshape(bh, *x.shape[2:])

    def stored(qz: Quantized) -> list[jax.Array]:
        arrays = [flat(qz.codes, fp8_native), flat(qz.scale)]
        return arrays + ([] if qz.zero is None else [flat(qz.zero)])

    arrays = [q, *stored(k), *stored(v), vis]
    whole = lambda a: pl.BlockSpec((None, *a.shape[1:]), lambda i, j: (i,) + (0,) * (a.ndim - 1))  # noqa: E731
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, bk=bk, bps=bps, nblocks=nblocks, nslots=nslots,
                               lay=lay, kz=k.zero is not None, vz=v.zero is not None, cdt=cdt, precision=precision,
                               fp8_native=fp8_native)
    logits, acc, m, l = pl.pallas_call(
        kernel,
        grid=(bh, splits),
        in_specs=[whole(a) for a in arrays],
        out_specs=[
            pl.BlockSpec((None, gp, sv), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, None, lay.per, gp, lay.piece), lambda i, j: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, gp), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, None, gp), lambda i, j: (i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((bh, gp, sv), jnp.float32),
            jax.ShapeDtypeStruct((bh, splits, lay.per, gp, lay.piece), jnp.float32),
            jax.ShapeDtypeStruct((bh, splits, gp), jnp.float32),
            jax.ShapeDtypeStruct((bh, splits, gp), jnp.float32),
        ],
        compiler_params=_compat.triton_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="kvjax_quantized_decode_attention_gpu",
    )(*arrays)
    # Merge the splits (log-sum-exp); a split with l = 0 has acc = 0 and drops out.
    m_all = jnp.max(m, axis=1, keepdims=True)
    w = jnp.where(l > 0, jnp.exp(m - m_all), 0.0)  # [BH, splits, Gp]
    total = jnp.sum(w * l, axis=1)  # [BH, Gp]
    out = jnp.sum(w[:, :, None, :, None] * acc, axis=1)  # [BH, per, Gp, D/per]
    out = jnp.where(total[:, None, :, None] > 0, out / jnp.maximum(total, 1e-37)[:, None, :, None], 0.0)
    lse = jnp.where(total > 0, m_all[:, 0] + jnp.log(jnp.maximum(total, 1e-37)), _common.MASK_VALUE)
    out = out[:, :, :g].transpose(0, 2, 1, 3).reshape(b, hq, d)
    return out, lse[:, :g].reshape(b, hq), logits[:, :g, :s].reshape(b, hkv, g, s)
