"""Decode attention over a segmented (ragged) per-row buffer: `reference.segment_decode_attention` (XLA;
no Pallas kernel yet). The attention op (`kvjax.kernels.attention`) runs it as its "segment" implementation."""

from kvjax.kernels.segment_attention.reference import segment_decode_attention, segment_decode_attention_lse

__all__ = ["segment_decode_attention", "segment_decode_attention_lse"]
