"""LookaheadKV modules (policies.md §11): learned lookahead tokens plus a LoRA active only on their rows.

- `LookaheadConfig`; `Adapter` (params pytree + config + model dimensions); `init_adapter`,
  `save`, `load` (safetensors + JSON; "bundled" is the bundled model's adapter); `stack` (an ensemble of
  adapters of one recipe, scored by the mean of their lookahead attention).
- `prompt_cache` (the frozen prompt prefill; `split_prompt_cache` / `join_prompt_cache` store and rebuild it), `predicted_attention` (s̃), `response_attention` (s_GT),
  `kl_loss`, `topk_loss`, `objective`, `loss_fn`: the training math (train_lookahead is the pipeline around it).

The model knows nothing of these modules beyond the row-masked adapter hook of `extend`.
"""

from kvjax.lookahead.adapter import BUNDLED, Adapter, ModelInfo, init_adapter, load, save, stack
from kvjax.lookahead.attention import (
    adapter_hook,
    PROMPT_CACHE_GLOBAL,
    PROMPT_CACHE_LOCAL,
    check_positions,
    join_prompt_cache,
    lookahead_fields,
    lookahead_mass,
    lookahead_observations,
    lookahead_rows,
    predicted_attention,
    prompt_cache,
    response_attention,
    split_prompt_cache,
)
from kvjax.lookahead.config import PROJECTIONS, TRAINED_FIELDS, LookaheadConfig
from kvjax.lookahead.loss import LOSSES, kl_loss, loss_fn, objective, topk_loss

__all__ = [
    "BUNDLED",
    "LOSSES",
    "PROJECTIONS",
    "PROMPT_CACHE_GLOBAL",
    "PROMPT_CACHE_LOCAL",
    "TRAINED_FIELDS",
    "Adapter",
    "LookaheadConfig",
    "ModelInfo",
    "adapter_hook",
    "check_positions",
    "init_adapter",
    "join_prompt_cache",
    "kl_loss",
    "load",
    "lookahead_fields",
    "lookahead_mass",
    "lookahead_observations",
    "lookahead_rows",
    "loss_fn",
    "objective",
    "predicted_attention",
    "prompt_cache",
    "response_attention",
    "save",
    "split_prompt_cache",
    "stack",
    "topk_loss",
]
