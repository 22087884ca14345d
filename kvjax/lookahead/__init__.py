"""LookaheadKV modules (policies.md §11): learned lookahead tokens plus a LoRA active only on their rows.

- `LookaheadConfig`; `Adapter` (params pytree + config + model dimensions); `init_adapter`,
  `save`, `load` (safetensors + JSON; "bundled" is the bundled model's adapter).
- `prompt_cache` (the frozen prompt prefill), `predicted_attention` (s̃), `response_attention` (s_GT),
  `kl_loss`, `topk_loss`, `objective`, `loss_fn`: the training math (train_lookahead is the pipeline around it).

The model knows nothing of these modules beyond the row-masked adapter hook of `extend`.
"""

from kvjax.lookahead.adapter import BUNDLED, Adapter, ModelInfo, init_adapter, load, save
from kvjax.lookahead.attention import (
    adapter_hook,
    check_positions,
    lookahead_mass,
    lookahead_observations,
    predicted_attention,
    prompt_cache,
    response_attention,
)
from kvjax.lookahead.config import PROJECTIONS, LookaheadConfig
from kvjax.lookahead.loss import LOSSES, kl_loss, loss_fn, objective, topk_loss

__all__ = [
    "BUNDLED",
    "LOSSES",
    "PROJECTIONS",
    "Adapter",
    "LookaheadConfig",
    "ModelInfo",
    "adapter_hook",
    "check_positions",
    "init_adapter",
    "kl_loss",
    "load",
    "lookahead_mass",
    "lookahead_observations",
    "loss_fn",
    "objective",
    "predicted_attention",
    "prompt_cache",
    "response_attention",
    "save",
    "topk_loss",
]
