"""Decode attention over quantized keys and values: the codes are dequantized inside the kernel
(`reference` is the XLA path and the oracle)."""

from kvjax.kernels.quantized_attention.api import quantized_decode_attention

__all__ = ["quantized_decode_attention"]
