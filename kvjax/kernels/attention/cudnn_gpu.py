"""cuDNN's fused flash attention for a prefill's self-attention on NVIDIA GPUs: no kvjax kernel, the one
`jax.nn.dot_product_attention(implementation="cudnn")` calls.

On an H200 (eval/device/probes/prefill_attention_h200.json) it runs a [1, 32 query heads, n, 64] bf16
causal prefill over 8 KV heads in 0.98 ms at 8K and 10.1 ms at 32K, against 12.6 / 168 ms for
`flash_xla` (blocked online softmax under lax loops) and 0.75 / 9.1 ms for torch's sdpa; XLA's own
`dot_product_attention` materialises the logits (out of memory at 32K).

cuDNN masks by index (causal, plus per-row sequence lengths), so it equals `flash_xla.flash_attention`
only when every row is right-padded and its real positions increase along the index
(`right_padded_index_causal`); the attention op runs it under a `lax.cond` with flash attention as the
other branch. Its log-sum-exp comes back in the inputs' dtype (bfloat16), too coarse to score with, so
this path returns the output only; a caller that needs the column mass gets it from the two-pass
column-mass kernel, which computes its own float32 log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.kernels.attention.splash_tpu import index_causal

DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's flash attention takes half-precision inputs only


def right_padded_index_causal(q_pos: jax.Array) -> jax.Array:
    """Scalar bool: every row of q_pos [B,n] is its real tokens (>= 0) first, then padding (-1), and the
    real positions increase along the index, so that causal by index with per-row lengths is causal by
    position."""
    real = q_pos >= 0
    prefix = jnp.all(real[:, 1:] <= real[:, :-1]) if q_pos.shape[1] > 1 else jnp.bool_(True)
    return prefix & index_causal(q_pos)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float, *,
                    implementation: str = "cudnn") -> jax.Array:
    """A prefill's self-attention: q [B,Hq,n,D], k/v [B,Hkv,n,D] (the keys of the same n tokens), q_pos
    [B,n] right-padded (-1 = padding). Causal by index within each row's real length; equal to
    `flash_attention` when `right_padded_index_causal(q_pos)`. Returns out [B,Hq,n,D] in q's dtype, zeros
    for padding queries. implementation: "cudnn", or "xla" (the same call through XLA: CPU tests).
    """
    lengths = jnp.sum(q_pos >= 0, axis=1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3), k.astype(q.dtype).transpose(0, 2, 1, 3), v.astype(q.dtype).transpose(0, 2, 1, 3),
        scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation=implementation)
    out = out.transpose(0, 2, 1, 3)
    return jnp.where((q_pos >= 0)[:, None, :, None], out, 0).astype(q.dtype)
