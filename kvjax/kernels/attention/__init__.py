"""The attention op (`api.attention`): one entry point over a table of implementations, with a default
order per backend and fallback when one declines (see `api`). Key sets in `keys`; plain-XLA
implementations in `reference`, the blocked flash path in `flash_xla`, jax's splash kernel in `splash_tpu`."""

from kvjax.kernels.attention.api import (
    ENV_VAR,
    IMPLEMENTATIONS,
    RETURNS,
    Attention,
    Options,
    attention,
    default_order,
    order,
)
from kvjax.kernels.attention.keys import Keys, QuantizedKeys, QuantizedSegmentedKeys, SegmentedKeys
from kvjax.kernels.attention.reference import softcap

__all__ = ["ENV_VAR", "IMPLEMENTATIONS", "RETURNS", "Attention", "Keys", "Options",
           "QuantizedKeys", "QuantizedSegmentedKeys", "SegmentedKeys", "attention", "default_order", "order", "softcap"]
