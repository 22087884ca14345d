"""Attention over the quantized segmented layout (`QuantizedSegmentedKeys`): one decode query per row.

The quantized slots are dequantized inside the computation (codes times scales, in XLA, fused by the
compiler into the logits and the weighted sum; no dequantized cache is kept) and attended per segment
(`kvjax.kernels.segment_attention.segment_decode_attention_lse`: each slot meets only the query heads of
its own KV head); the per-head full-precision window is attended as in `quantized.window`; the two parts
are merged by their log-sum-exp (`quantized.merge`). Keys and values stored rotated (`config.rotation`)
meet a rotated query, and that part's output is rotated back, as in `quantized`. No Pallas kernel yet:
the work is proportional to the slots stored, as for the full-precision segments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import kv_quant
from kvjax.kernels.attention.keys import QuantizedSegmentedKeys
from kvjax.kernels.attention.quantized import merge, window
from kvjax.kernels.segment_attention import segment_decode_attention_lse


def decode(q: jax.Array, keys: QuantizedSegmentedKeys, q_pos: jax.Array, *, scale: float, softcap: float | None
           ) -> tuple[jax.Array, jax.Array]:
    """q [B,Hq,1,D] at q_pos [B,1]: out [B,Hq,1,D] (q dtype), lse [B,Hq,1] (0 for a row that sees nothing)."""
    cfg = keys.config
    S = keys.pos.shape[-1]
    H = keys.rk.shape[1]
    q1 = q[:, :, 0]
    seg = jnp.where((keys.pos >= 0) & (keys.pos <= q_pos[:, :1]), keys.seg, -1)
    k = kv_quant.dequantize(keys.k, cfg)[:, :S]
    v = kv_quant.dequantize(keys.v, cfg)[:, :S]
    out_q, lse_q = segment_decode_attention_lse(kv_quant.rotate(q1, cfg).astype(jnp.float32), k, v, seg,
                                                num_kv_heads=H, scale=scale, softcap=softcap)
    out_q = kv_quant.rotate(out_q, cfg)  # H @ H = I: rotated back
    out_r, lse_r, _ = window(q1, keys, q_pos, scale, softcap)
    out, lse = merge(out_q, lse_q, out_r, lse_r)
    return out[:, :, None].astype(q.dtype), lse[:, :, None]
