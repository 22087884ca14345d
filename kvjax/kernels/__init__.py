"""Scoring kernels for KV-cache eviction.

Each op has a pure-jnp reference (the XLA path), a Pallas TPU (Mosaic) kernel, a Pallas GPU
(Triton) kernel and one dispatcher; policies call only the three functions below.

  window_scores(queries, keys, query_positions, key_positions, *, scale, group_reduce, moments, implementation)
  column_mass(queries, keys, query_positions, key_positions, *, scale, lse, implementation)
  decode_attention(query, keys, values, valid, *, scale, implementation)

``implementation``: None (Pallas on TPU/GPU, XLA reference on CPU; window_scores keeps XLA on GPU), "xla", "pallas_tpu",
"pallas_gpu" or "interpret" (the TPU kernel in Pallas interpret mode, for CPU tests), or a
sequence of them (the first available). Each op's ``api.TABLE`` maps these names to functions;
the default order per backend and the ``KVJAX_KERNEL_IMPLEMENTATION`` override are in ``_dispatch``.
Score reductions shared with the policies (moments, GQA group reduction) are in ``reductions``.
"""

# Import the op packages first: binding the functions afterwards means the names below refer to
# the functions, not to the op subpackages of the same name.
import kvjax.kernels.column_mass.api as _column_mass_api
import kvjax.kernels.decode_attention.api as _decode_attention_api
import kvjax.kernels.window_scores.api as _window_scores_api
from kvjax.kernels._common import IMPLEMENTATIONS, masked_softmax

column_mass = _column_mass_api.column_mass
decode_attention = _decode_attention_api.decode_attention
window_scores = _window_scores_api.window_scores

__all__ = ["IMPLEMENTATIONS", "column_mass", "decode_attention", "masked_softmax", "window_scores"]
