"""Quantized KV storage: the configuration (`KVQuant`), the quantizer and the byte packing.

Choices and why:
- **Formats**: int8, fp8 (e4m3), int4 and int2. Codes come from qwix's quantizer (`qwix.quantize`:
  calibration, scale, rounding; absmax = symmetric, minmax = asymmetric with a zero point). int4 and
  int2 codes are stored unsigned and **packed into bytes** (2 or 4 per uint8), because Pallas on TPU
  has no 4-bit type; int8 and fp8 are stored as they are.
- **Packing by halves / quarters of head_dim**: byte j of a row holds element j in its low bits,
  element j + D/2 (int4) or j + D/4, j + D/2, j + 3D/4 (int2) above. Unpacking is shifts and masks
  that give contiguous pieces of the row, so a kernel dots each piece with the matching piece of the
  query and never interleaves lanes.
- **Keys per token** (default): one scale (and zero point) per slot and KV head, or per `group`
  channels along head_dim. Per-slot scales ride through compaction, eviction and the ragged layout
  with the codes, unchanged. **Keys per channel** (`key_axis="channel"`, KIVI): one scale per channel
  over `group` consecutive slots; groups are formed after compaction and decode appends fill the
  full-precision window first, so no slot ever leaves its group.
- **Values per token** always (KIVI, every JAX engine): attention sums values weighted per slot.
- **Rotation** (`rotation="hadamard"`, for 4 and 2 bits): keys and values are multiplied by an
  orthonormal Hadamard matrix H before quantizing; queries are rotated alike, so q.k is unchanged,
  and the attention output is rotated back (H is symmetric). It spreads outlier channels over all of
  head_dim, which is what lets a per-token scale work at low bits (QuaRot, TurboQuant).
- **Full-precision window** (`residual` R): the most recent entries that decode appends write stay in
  the model dtype until R of them gather; then all R are quantized at once (a fixed-size flush, so
  shapes never change). With per-channel keys R is a multiple of `group` (KIVI: 128 over groups of 32).
- **Scales and zero points are float16 / int8**: 2 and 1 bytes per group, counted in the cache's bytes.

Shapes below: x [..., D] (any leading axes; the slot axis is -2 where it matters).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import struct

FORMATS = ("int8", "fp8", "int4", "int2", "bf16")
BITS = {"int8": 8, "fp8": 8, "int4": 4, "int2": 2, "bf16": 16}
KEY_AXES = ("token", "channel")
ROTATIONS = (None, "hadamard")
# the signed range of each integer format's codes (stored unsigned: code - QMIN)
QMIN = {"int8": -128, "int4": -8, "int2": -2}
SCALE_DTYPE = jnp.float16


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How the kept keys and values are stored.

    format: "int8", "fp8" (e4m3), "int4" or "int2"; "bf16" stores bfloat16 values with a scale of 1 (the
      quantized layout without rounding beyond bfloat16: a bf16 model decodes exactly as from its dense cache).
    key_axis: "token" (a scale per slot, or per `group` channels) or "channel" (a scale per channel
      over `group` consecutive slots, KIVI).
    group: channels per scale along head_dim for per-token scales (None: all of head_dim), or slots per
      group for per-channel keys (None: 32).
    residual: entries of the full-precision window that decode appends go to (flushed when full).
    rotation: None or "hadamard" (4 and 2 bits).
    asymmetric: min/max with a zero point (integer formats) instead of symmetric absmax.
    """

    format: str = "int8"
    key_axis: str = "token"
    group: int | None = None
    residual: int = 0
    rotation: str | None = None
    asymmetric: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"kv_quant format must be one of {FORMATS}, got {self.format!r}")
        if self.key_axis not in KEY_AXES:
            raise ValueError(f"kv_quant key_axis must be one of {KEY_AXES}, got {self.key_axis!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"kv_quant rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.rotation is not None and self.format not in ("int4", "int2"):
            raise ValueError(f"kv_quant rotation={self.rotation!r} is for int4 and int2, not {self.format!r}")
        if self.asymmetric and self.format in ("fp8", "bf16"):
            raise ValueError(f"kv_quant asymmetric=True is for the integer formats, not {self.format!r}")
        for name in ("group", "residual"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"kv_quant {name} must be a non-negative int, got {value!r}")
        if self.group == 0:
            raise ValueError("kv_quant group must be positive (or None)")
        if self.key_axis == "channel" and (self.residual < self.slot_group or self.residual % self.slot_group):
            raise ValueError(f"kv_quant key_axis='channel' needs residual (got {self.residual}) a positive multiple "
                             f"of its slot group {self.slot_group}")

    @property
    def bits(self) -> int:
        return BITS[self.format]

    @property
    def slot_group(self) -> int:
        """Slots sharing one key scale per channel (key_axis "channel")."""
        return self.group or 32

    def channel_group(self, head_dim: int) -> int:
        """Channels sharing one scale along head_dim (per-token scales; keys per channel: values only)."""
        g = head_dim if self.group is None or self.key_axis == "channel" else self.group
        return g

    def check(self, head_dim: int) -> None:
        """ValueError unless this configuration fits a model of `head_dim`."""
        g = self.channel_group(head_dim)
        if g > head_dim or head_dim % g:
            raise ValueError(f"kv_quant group={g} must divide head_dim={head_dim} (and not exceed it)")
        per_byte = max(1, 8 // self.bits)
        if head_dim % per_byte:
            raise ValueError(f"kv_quant {self.format} packs {per_byte} codes per byte: head_dim={head_dim} must be a "
                             "multiple")
        if self.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(f"kv_quant rotation='hadamard' needs a power-of-two head_dim, got {head_dim}")

    @property
    def name(self) -> str:
        """The preset name when this is one (`PRESETS`), else a description."""
        for k, v in PRESETS.items():
            if v == self:
                return k
        return repr(self)


# int4: one scale per slot and head after a Hadamard rotation (2 bytes per head_dim codes: 3.5x a bf16
# cache's slot with its position and valid bit); int4_g32 / int4_kivi spend more bytes on scales for
# accuracy; int2: naive group-wise (min/max per 32 channels); int2_hadamard / int2_kivi the remedies.
# int8_g16: a scale per 16 channels (9 bits per element instead of 8.25), so a key's outlier channels widen
# only their own group's steps (a candidate for int8 on small-head models; eval/README, issue 26).
PRESETS: dict[str, KVQuant] = {
    "int8": KVQuant("int8"),
    "int8_g16": KVQuant("int8", group=16),
    "fp8": KVQuant("fp8"),
    "int4": KVQuant("int4", rotation="hadamard", residual=128),
    "int4_g32": KVQuant("int4", group=32, asymmetric=True, residual=128),
    "int4_kivi": KVQuant("int4", key_axis="channel", group=32, residual=128, asymmetric=True),
    "int2": KVQuant("int2", group=32, residual=128, asymmetric=True),
    "int2_hadamard": KVQuant("int2", group=32, rotation="hadamard", residual=128, asymmetric=True),
    "int2_kivi": KVQuant("int2", key_axis="channel", group=32, residual=128, asymmetric=True),
    "bf16": KVQuant("bf16", residual=128),
}


def resolve(kv_quant: str | KVQuant | None) -> KVQuant | None:
    """A `KVQuant` from a preset name (`PRESETS`), a `KVQuant`, or None / "none" (full precision)."""
    if kv_quant is None or kv_quant == "none":
        return None
    if isinstance(kv_quant, KVQuant):
        return kv_quant
    if isinstance(kv_quant, str) and kv_quant in PRESETS:
        return PRESETS[kv_quant]
    raise ValueError(f"kv_quant must be None, 'none', one of {tuple(PRESETS)} or a kvjax.kv_quant.KVQuant, "
                     f"got {kv_quant!r}")


@struct.dataclass
class Quantized:
    """Quantized rows. codes [..., S, Dc]: int8 / float8_e4m3fn [..., S, D], or uint8 packed
    [..., S, D * bits / 8]; scale float16 and zero (int8, or None when symmetric) shaped
    [..., S, D / g] (per token) or [..., S / G, D] (per channel over G slots)."""

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None


def _qtype(fmt: str) -> Any:
    return {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "int2": "int2"}[fmt]


def pack(q: jax.Array, fmt: str) -> jax.Array:
    """Signed integer codes q [..., D] (int4 / int2 ranges) as uint8 [..., D * bits / 8], by pieces of D."""
    per = 8 // BITS[fmt]
    u = (q.astype(jnp.int32) - QMIN[fmt]).astype(jnp.uint8)
    pieces = jnp.split(u, per, axis=-1)
    out = pieces[0]
    for i, p in enumerate(pieces[1:], start=1):
        out = out | (p << (BITS[fmt] * i))
    return out


def unpack(codes: jax.Array, fmt: str) -> jax.Array:
    """The inverse of `pack`: int32 signed codes [..., D]."""
    bits = BITS[fmt]
    per, mask = 8 // bits, (1 << bits) - 1
    c = codes.astype(jnp.int32)
    return jnp.concatenate([((c >> (bits * i)) & mask) + QMIN[fmt] for i in range(per)], axis=-1)


@functools.lru_cache(maxsize=8)
def _hadamard_np(d: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def hadamard(d: int, dtype: Any = jnp.float32) -> jax.Array:
    """The orthonormal, symmetric Sylvester-Hadamard matrix [d, d] (d a power of two): H @ H = I."""
    return jnp.asarray(_hadamard_np(d), dtype)


def rotate(x: jax.Array, config: KVQuant) -> jax.Array:
    """x [..., D] times H when the configuration rotates (float32), else x."""
    if config.rotation is None:
        return x
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), hadamard(x.shape[-1]))


def quantize(x: jax.Array, config: KVQuant, *, per_channel: bool = False, valid: jax.Array | None = None
             ) -> Quantized:
    """Quantizes x [..., S, D] (already rotated when the configuration rotates).

    per_channel: one scale per channel over groups of `config.slot_group` slots (S a multiple), else one
    per slot and `config.channel_group(D)` channels. valid [..., S]: slots whose values count for the
    scales (others are zeroed first, so an empty slot never widens a group's range).
    """
    D = x.shape[-1]
    if valid is not None:
        x = jnp.where(valid[..., None], x, 0)
    x = x.astype(jnp.float32)
    if config.format == "bf16":
        *lead_shape, S, _ = x.shape
        shape = (*lead_shape, S // config.slot_group, D) if per_channel else (*lead_shape, S, D // config.channel_group(D))
        return Quantized(codes=x.astype(jnp.bfloat16), scale=jnp.ones(shape, SCALE_DTYPE))
    lead = tuple(range(x.ndim - 2))
    if per_channel:
        tiled = {x.ndim - 2: config.slot_group}
        channelwise = lead + (x.ndim - 1,)
    else:
        tiled = {x.ndim - 1: config.channel_group(D)}
        channelwise = lead + (x.ndim - 2,)
    if config.asymmetric and config.format == "int2":  # qwix has min/max bounds for int8 / int4 only
        scale, zero = _int2_minmax(x, per_channel, config)
    else:
        q = qwix.quantize(x, _qtype(config.format), channelwise_axes=channelwise, tiled_axes=tiled,
                          calibration_method="minmax" if config.asymmetric else "absmax", scale_dtype=jnp.float32)
        scale, zero = q.scale, q.zero_point
    scale = _round_up(scale)
    zero = None if zero is None else zero.astype(jnp.int8)
    # round the codes against the stored (float16) scale, so dequantizing reproduces them exactly
    q = qwix.QArray(qvalue=_requantize(x, scale, zero, config, per_channel), scale=scale, zero_point=zero)
    if config.format in ("int4", "int2"):
        codes = pack(q.qvalue, config.format)
    elif config.format == "int8":
        codes = q.qvalue.astype(jnp.int8)
    else:
        codes = q.qvalue
    return Quantized(codes=codes, scale=scale, zero=zero)


def _round_up(scale: jax.Array) -> jax.Array:
    """The float16 scale at or above `scale` (float32), so that no value lands past the outermost code."""
    s16 = scale.astype(SCALE_DTYPE)
    return jnp.where(s16.astype(jnp.float32) < scale, jnp.nextafter(s16, jnp.asarray(jnp.inf, SCALE_DTYPE)), s16)


def _int2_minmax(x: jax.Array, per_channel: bool, config: KVQuant) -> tuple[jax.Array, jax.Array]:
    """Asymmetric int2 scale and zero point with qwix's conventions (the range widened to hold 0;
    x ~ (code - zero) * scale, codes in [-2, 1])."""
    *lead, S, D = x.shape
    if per_channel:
        tiles, axis = x.reshape(*lead, S // config.slot_group, config.slot_group, D), -2
    else:
        g = config.channel_group(D)
        tiles, axis = x.reshape(*lead, S, D // g, g), -1
    lo, hi = jnp.minimum(tiles.min(axis), 0.0), jnp.maximum(tiles.max(axis), 0.0)
    scale = (hi - lo) / 3.0
    scale = jnp.where(scale < jnp.sqrt(jnp.finfo(jnp.float32).tiny), 1.0, scale)
    zero = jnp.round(-2.0 - lo / scale).clip(-2, 1)
    return scale, zero


def _broadcast(s: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A scale or zero point [..., S', D'] repeated up to `shape` [..., S, D] (tiles of S/S' x D/D')."""
    for axis in (-2, -1):
        s = jnp.repeat(s, shape[axis] // s.shape[axis], axis=axis)
    return s


def _requantize(x: jax.Array, scale: jax.Array, zero: jax.Array | None, config: KVQuant, per_channel: bool
                ) -> jax.Array:
    s = _broadcast(scale.astype(jnp.float32), x.shape)
    y = x / s
    if config.format == "fp8":
        return y.clip(-448.0, 448.0).astype(jnp.float8_e4m3fn)
    lo, hi = QMIN[config.format], -QMIN[config.format] - 1
    if zero is not None:
        y = y + _broadcast(zero.astype(jnp.float32), x.shape)
    return jnp.round(y).clip(lo, hi).astype(jnp.int8)


def codes_of(q: Quantized, config: KVQuant) -> jax.Array:
    """The signed codes [..., S, D] of `q` (float8 for fp8)."""
    if config.format in ("int4", "int2"):
        return unpack(q.codes, config.format)
    return q.codes


def dequantize(q: Quantized, config: KVQuant, dtype: Any = jnp.float32) -> jax.Array:
    """[..., S, D] values of `q` (still rotated when the configuration rotates): qwix's dequantize of
    the unpacked codes, (code - zero) * scale."""
    codes = codes_of(q, config)
    if config.format == "bf16":
        return (codes.astype(jnp.float32) * _broadcast(q.scale.astype(jnp.float32), codes.shape)).astype(dtype)
    qtype = jnp.float8_e4m3fn if config.format == "fp8" else jnp.int8
    arr = qwix.QArray(qvalue=codes.astype(qtype), scale=q.scale.astype(jnp.float32), zero_point=q.zero)
    return qwix.dequantize(arr).astype(dtype)


def nbytes(q: Quantized) -> int:
    """Bytes of codes, scales and zero points."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(q))
