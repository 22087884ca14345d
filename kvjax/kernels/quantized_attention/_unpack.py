"""In-kernel decoding of the quantized storage (`kvjax.kv_quant`), shared by the Pallas TPU and GPU kernels.

Everything here is elementwise jnp on small tiles (shifts, masks, selects, bit casts), so it traces
inside a Pallas kernel body on either backend and also runs in plain XLA (which is how the tests check
it against `kv_quant.dequantize`).

- `layout(config, D)`: how a row of head_dim D is stored (pieces, bytes, scale groups).
- Packed int4 / int2 codes: byte j of a row holds element j + i·D/per in bits [bits·i, bits·(i+1)), so
  piece i is ``(byte >> bits·i) & mask``: a contiguous block of D/per channels, at the same lanes as
  the bytes (no lane movement at all).
- float16 scales are read as their int16 bits and decoded with integer ops (`f16_bits_to_f32`), and
  float8_e4m3fn codes as their uint8 bits (`e4m3_bits_to_f32`): Mosaic's float16 and float8 support
  varies across TPU generations, while 8/16/32-bit integer loads, shifts and selects work on all of them.
  Both decoders are exact (normal and subnormal values; float16 inf / NaN included).
- A dequantized element is ``code · scale + bias`` with ``bias = (offset - zero) · scale`` formed once per
  scale group (offset = QMIN for the unsigned packed codes, 0 for int8): every term is exact in float32
  ((code - zero) has at most 8 significant bits, a float16 scale 11), so it equals qwix's
  ``(code - zero) · scale`` bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvjax.kv_quant import BITS, QMIN, KVQuant


class Unsupported(NotImplementedError):
    """A kernel cannot run this combination (the reason says why); the dispatcher falls back to XLA."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How rows of head_dim D are stored under a configuration (all static ints)."""

    fmt: str
    bits: int
    per: int  # codes per byte (pieces of head_dim): 1 (int8 / fp8), 2 (int4), 4 (int2)
    head_dim: int
    piece: int  # D / per: channels per piece = bytes of codes per row for packed formats
    code_bytes: int  # bytes of codes per row
    offset: int  # added to the stored code before subtracting the zero point (QMIN for packed codes)
    key_channel: bool  # keys scaled per channel over `slot_group` slots
    slot_group: int
    group: int  # channels per scale for per-token scales (keys when not per channel; values always)

    @property
    def groups(self) -> int:
        """Per-token scale groups along head_dim."""
        return self.head_dim // self.group


def layout(config: KVQuant, head_dim: int) -> Layout:
    config.check(head_dim)
    bits = config.bits
    packed = config.format in ("int4", "int2")
    per = 8 // bits if packed else 1
    return Layout(fmt=config.format, bits=bits, per=per, head_dim=head_dim, piece=head_dim // per,
                  code_bytes=head_dim * bits // 8, offset=QMIN[config.format] if packed else 0,
                  key_channel=config.key_axis == "channel", slot_group=config.slot_group,
                  group=config.channel_group(head_dim))


def bytes_per_slot(config: KVQuant, head_dim: int) -> float:
    """HBM bytes a kernel reads per slot for keys and values together: codes, scales (2 bytes) and zero
    points (1 byte); per-channel key scales are shared by `slot_group` slots."""
    lay = layout(config, head_dim)
    zero = 1 if config.asymmetric else 0
    per_token = lay.code_bytes + lay.groups * (2 + zero)
    key = lay.code_bytes + head_dim * (2 + zero) / lay.slot_group if lay.key_channel else per_token
    return key + per_token


def f16_bits_to_f32(h: jax.Array) -> jax.Array:
    """float16 values from their bits (int32 holding the int16 bits, sign-extended or not) -> float32."""
    h = h & 0xFFFF
    e = lax.shift_right_logical(h, 10) & 0x1F
    m = h & 0x3FF
    normal = lax.bitcast_convert_type(lax.shift_left(h & 0x7FFF, 13) + (112 << 23), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * (2.0 ** -24), normal)
    mag = jnp.where(e == 31, jnp.where(m == 0, jnp.float32(jnp.inf), jnp.float32(jnp.nan)), mag)
    return jnp.where((h & 0x8000) != 0, -mag, mag)


def e4m3_bits_to_f32(u: jax.Array) -> jax.Array:
    """float8_e4m3fn values from their bits (int32 in [0, 255]) -> float32. The NaN codes 0x7F / 0xFF
    (never written: the quantizer clips to +-448) decode as +-480."""
    mag_bits = u & 0x7F
    normal = lax.bitcast_convert_type(lax.shift_left(mag_bits, 20) + (120 << 23), jnp.float32)
    mag = jnp.where(mag_bits < 8, (u & 7).astype(jnp.float32) * (2.0 ** -9), normal)
    return jnp.where((u & 0x80) != 0, -mag, mag)


def scale_f32(raw: jax.Array) -> jax.Array:
    """Scales as loaded in a kernel (int16 bits of float16, or any float) -> float32."""
    if jnp.issubdtype(raw.dtype, jnp.integer):
        return f16_bits_to_f32(raw.astype(jnp.int32))
    return raw.astype(jnp.float32)


def scale_and_bias(raw_scale: jax.Array, raw_zero: jax.Array | None, lay: Layout
                   ) -> tuple[jax.Array, jax.Array | None]:
    """float32 scale and bias (offset - zero) * scale, same shape as the loaded scale tile; bias None
    when it is zero (symmetric int8 / fp8)."""
    sc = scale_f32(raw_scale)
    if raw_zero is not None:
        return sc, (lay.offset - raw_zero.astype(jnp.int32)).astype(jnp.float32) * sc
    if lay.offset:
        return sc, sc * float(lay.offset)
    return sc, None


def storage_bits(codes: jax.Array) -> jax.Array:
    """What a kernel reads for the codes: uint8 bits for float8 (a free bitcast), else the codes."""
    if codes.dtype == jnp.float8_e4m3fn:
        return lax.bitcast_convert_type(codes, jnp.uint8)
    return codes


def storage_scale(scale: jax.Array) -> jax.Array:
    """What a kernel reads for float16 scales: their int16 bits (a free bitcast)."""
    if scale.dtype == jnp.float16:
        return lax.bitcast_convert_type(scale, jnp.int16)
    return scale


def code_pieces(raw: jax.Array, lay: Layout, *, native_fp8: bool = False) -> list[jax.Array]:
    """The `per` float32 pieces [n, D/per] of a tile of stored codes [n, code_bytes] (uint8 packed,
    int8, or the uint8 bits of float8; float8 itself when native_fp8)."""
    if lay.fmt == "fp8":
        if native_fp8:
            return [raw.astype(jnp.float32)]
        return [e4m3_bits_to_f32(raw.astype(jnp.int32))]
    u = raw.astype(jnp.int32)
    if lay.per == 1:
        return [u.astype(jnp.float32)]
    mask = (1 << lay.bits) - 1
    out = []
    for i in range(lay.per):
        c = lax.shift_right_logical(u, lay.bits * i) if i else u
        if i < lay.per - 1:  # the top piece of a byte needs no mask
            c = c & mask
        out.append(c.astype(jnp.float32))
    return out


def lane_column(x: jax.Array, j: int) -> jax.Array:
    """Column j of a tile [n, m] as [n, 1], by a masked lane reduction (no unaligned lane slice)."""
    if x.shape[1] == 1:
        return x
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(lane == j, x, 0.0), axis=1, keepdims=True)


def token_piece(x: jax.Array, p: int, lay: Layout) -> jax.Array:
    """Per-token scales (or biases) [n, D/g] spread over piece p: [n, 1] when the piece lies in one
    group, else [n, D/per] (selects on the lane index)."""
    lo, hi = p * lay.piece, (p + 1) * lay.piece  # channels of the piece
    first, last = lo // lay.group, (hi - 1) // lay.group
    out = lane_column(x, first)
    if first == last:
        return out
    lane = lax.broadcasted_iota(jnp.int32, (x.shape[0], lay.piece), 1)
    out = jnp.broadcast_to(out, (x.shape[0], lay.piece))
    for j in range(first + 1, last + 1):
        out = jnp.where(lane >= j * lay.group - lo, lane_column(x, j), out)
    return out


def channel_piece(x: jax.Array, p: int, lay: Layout) -> jax.Array:
    """Lanes [p·D/per, (p+1)·D/per) of a per-channel tile [r, D], by an exact 0/1 selection matmul
    (moves lanes on the MXU instead of an unaligned lane slice)."""
    if lay.per == 1:
        return x
    d, w = lay.head_dim, lay.piece
    rows = lax.broadcasted_iota(jnp.int32, (d, w), 0)
    cols = lax.broadcasted_iota(jnp.int32, (d, w), 1)
    sel = jnp.where(rows == cols + p * w, 1.0, 0.0).astype(jnp.float32)
    return lax.dot_general(x, sel, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def repeat_rows(x: jax.Array, times: int) -> jax.Array:
    """[r, w] -> [r·times, w], each row repeated `times` times (per-channel key scales over their
    slot group). A sublane broadcast when `times` is a multiple of 8, else an exact 0/1 matmul, before
    which non-finite entries become 0 (a matmul would spread one garbage NaN of an invisible group over
    every row: 0 · NaN = NaN)."""
    r, w = x.shape
    if times == 1:
        return x
    if times % 8 == 0:
        return jnp.broadcast_to(x[:, None, :], (r, times, w)).reshape(r * times, w)
    x = jnp.where(jnp.abs(x) <= jnp.finfo(jnp.float32).max, x, 0.0)
    rows = lax.broadcasted_iota(jnp.int32, (r * times, r), 0)
    cols = lax.broadcasted_iota(jnp.int32, (r * times, r), 1)
    rep = jnp.where((rows >= cols * times) & (rows < (cols + 1) * times), 1.0, 0.0).astype(jnp.float32)
    return lax.dot_general(rep, x, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


__all__ = ["BITS", "Unsupported", "Layout", "layout", "bytes_per_slot", "f16_bits_to_f32", "e4m3_bits_to_f32",
           "scale_and_bias", "code_pieces", "token_piece", "channel_piece", "repeat_rows", "storage_bits",
           "storage_scale"]
