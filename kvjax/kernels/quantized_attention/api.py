"""Public dispatcher for decode attention over quantized keys and values (`kvjax.kv_quant`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from kvjax.kernels import _common, _dispatch
from kvjax.kernels.quantized_attention import reference
from kvjax.kv_quant import KVQuant, Quantized

# backend -> implementation; backends without a kernel of their own run the XLA reference
IMPLEMENTATIONS = {"xla": reference.quantized_decode_attention}


def quantized_decode_attention(query: jax.Array, k: Quantized, v: Quantized, visible: jax.Array, *, scale: float,
                               config: KVQuant, softcap: float | None = None,
                               implementation: str | Sequence[str] | None = None
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step of attention over quantized storage (see `reference.quantized_decode_attention`
    for shapes and results). implementation: as for every kernel op (`kvjax.kernels._dispatch`)."""
    impl = _dispatch.resolve_implementation(implementation, "quantized_decode_attention")
    scale = _common.check_scale(scale)
    _common.check_array("query", query, 3, "float")
    _common.check_array("visible", visible, 3, "bool")
    fn = IMPLEMENTATIONS.get(impl, IMPLEMENTATIONS["xla"])
    return fn(query, k, v, visible, scale=scale, config=config, softcap=softcap)
