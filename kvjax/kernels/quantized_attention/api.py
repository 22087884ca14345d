"""Public dispatcher for decode attention over quantized keys and values (`kvjax.kv_quant`).

Implementations (`kvjax.kernels._dispatch`): "xla" (`reference`, also the CPU path), "pallas_tpu",
"pallas_gpu" and "interpret" (the TPU kernel in the Pallas interpreter). The default order per backend is
`_dispatch.DEFAULT_ORDER` (no per-op exception): the Pallas kernel first on TPU and on GPU, as for
decode_attention, whose Triton kernel measured 1.2-1.6x faster than XLA on an H100; this op has not been
measured on a GPU (reading 3-6x fewer bytes than a bfloat16 cache it should gain more, unless dequantizing
is compute-bound).

A kernel that cannot run a combination raises `_unpack.Unsupported` (a NotImplementedError) with the
reason before building anything (the Triton kernel needs power-of-two tiles); with `implementation=None`
(the default order, or $KVJAX_KERNEL_IMPLEMENTATION) the op then falls back to the XLA reference with a
warning; a kernel asked for by name raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax

from kvjax.kernels import _common, _dispatch
from kvjax.kernels.quantized_attention import _unpack, pallas_gpu, pallas_tpu, reference
from kvjax.kv_quant import KVQuant, Quantized

TABLE = _dispatch.table("quantized_decode_attention", xla=reference, pallas_tpu=pallas_tpu, pallas_gpu=pallas_gpu)


def _check_quantized(name: str, q: Quantized, config: KVQuant, lead: tuple[int, int], s: int, d: int,
                     per_channel: bool) -> None:
    if not isinstance(q, Quantized):
        raise TypeError(f"{name} must be a kvjax.kv_quant.Quantized, got {type(q).__name__}")
    codes = q.codes
    if codes.ndim != 4 or tuple(codes.shape[:2]) != lead or codes.shape[2] < s:
        raise ValueError(f"{name}.codes must be [B,Hkv,S',Dc] with (B,Hkv) = {lead} and S' >= {s}, got "
                         f"{tuple(codes.shape)}")
    width = d * config.bits // 8
    if codes.shape[3] != width:
        raise ValueError(f"{name}.codes: {config.format} stores {width} bytes per row of head_dim {d}, got "
                         f"{codes.shape[3]}")
    slots = codes.shape[2]
    if per_channel:
        grp = config.slot_group
        want = (*lead, slots // grp, d)
        if slots % grp:
            raise ValueError(f"{name}.codes: per-channel keys need S' (got {slots}) a multiple of {grp}")
    else:
        want = (*lead, slots, d // config.channel_group(d))
    if tuple(q.scale.shape) != want:
        raise ValueError(f"{name}.scale must have shape {want}, got {tuple(q.scale.shape)}")
    if (q.zero is not None) != config.asymmetric:
        raise ValueError(f"{name}.zero must be {'given' if config.asymmetric else 'None'} for {config!r}")
    if q.zero is not None and tuple(q.zero.shape) != want:
        raise ValueError(f"{name}.zero must have shape {want}, got {tuple(q.zero.shape)}")


def quantized_decode_attention(query: jax.Array, k: Quantized, v: Quantized, visible: jax.Array, *, scale: float,
                               config: KVQuant, softcap: float | None = None,
                               implementation: str | Sequence[str] | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step of attention over quantized storage.

    query [B,Hq,D] (rotated when the configuration rotates); k, v `Quantized` over [B,Hkv,S',...] (as
    `kv_quant.quantize` lays them out: keys per channel when config.key_axis == "channel"); visible
    [B,Hkv,S] bool, S <= S' (slots past S are never attended; invisible slots may hold anything).
    Returns out [B,Hq,D] float32 (0 for a head that sees nothing), lse [B,Hq] float32 (MASK_VALUE for a
    head that sees nothing) and logits [B,Hkv,G,S] float32 (scaled, soft-capped, MASK_VALUE where not
    visible). implementation: as for every kernel op (`kvjax.kernels._dispatch`; module docstring).
    """
    impl = TABLE.resolve(implementation)
    scale = _common.check_scale(scale)
    _common.check_array("query", query, 3, "float")
    _common.check_array("visible", visible, 3, "bool")
    if not isinstance(config, KVQuant):
        raise TypeError(f"config must be a kvjax.kv_quant.KVQuant, got {type(config).__name__}")
    if config.format == "bf16":  # the layout's 16-bit passthrough (no codes to unpack): the XLA path
        return TABLE["xla"](query, k, v, visible, scale=scale, config=config, softcap=softcap)
    b, hq, d = query.shape
    _, hkv, s = visible.shape
    if visible.shape[0] != b or hkv == 0 or hq % hkv:
        raise ValueError(f"visible {tuple(visible.shape)} must be [B,Hkv,S] with B = {b} and Hkv dividing the "
                         f"{hq} query heads")
    config.check(d)
    _check_quantized("k", k, config, (b, hkv), s, d, config.key_axis == "channel")
    _check_quantized("v", v, config, (b, hkv), s, d, False)
    if softcap is not None and not (isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
                                    and softcap > 0):
        raise ValueError(f"softcap must be None or a positive float, got {softcap!r}")
    try:
        return TABLE[impl](query, k, v, visible, scale=scale, config=config, softcap=softcap)
    except _unpack.Unsupported as err:
        if implementation is not None or impl == "xla":
            raise
        warnings.warn(f"quantized_decode_attention: {impl} cannot run this case ({err}); using the XLA reference",
                      stacklevel=2)
        return TABLE["xla"](query, k, v, visible, scale=scale, config=config, softcap=softcap)
