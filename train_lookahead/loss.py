"""The training loss for both target modes (policies.md §11.4).

Stored targets: kvjax.lookahead.loss_fn. On-the-fly targets: one frozen prompt prefill (under
stop_gradient) serves two continuations against its cache: the response (no gradient), reduced to
s_GT by kvjax.lookahead.response_attention, and the lookahead rows (with gradient), giving s̃;
then the run's objective (kvjax.lookahead.kl_loss, or topk_loss: `train.loss`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.lookahead import (
    LookaheadConfig,
    kl_loss,
    loss_fn,
    objective,
    predicted_attention,
    prompt_cache,
    response_attention,
)
from kvjax.models.config import ModelConfig


def on_the_fly_loss(adapter_params: Any, model_params: Any, model_cfg: ModelConfig, config: LookaheadConfig,
                    batch: dict[str, jax.Array], *, remat: bool = False, objective=kl_loss) -> jax.Array:
    """batch: tokens / positions [B, T], response / response_positions [B, Y] (-1 = pad)."""
    tokens, positions = batch["tokens"], batch["positions"]
    model_params = jax.lax.stop_gradient(model_params)
    cache = jax.lax.stop_gradient(prompt_cache(model_params, model_cfg, tokens, positions))
    target = jax.lax.stop_gradient(response_attention(model_params, model_cfg, cache, batch["response"],
                                                      batch["response_positions"]))
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    predicted = predicted_attention(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat)
    return objective(target, predicted, positions >= 0)


@functools.cache
def lookahead_loss(model_cfg: ModelConfig, config: LookaheadConfig, remat: bool = False, loss: str = "kl",
                   topk_fraction: float = 0.25):
    """loss(trainable, frozen, batch) for the train loop: stored targets when the batch has "target".
    loss / topk_fraction: the objective (`kvjax.lookahead.objective`). One function per argument set,
    so the train loop's compiled step is reused."""
    fn = objective(loss, topk_fraction)

    def loss(trainable: Any, frozen: Any, batch: dict[str, jax.Array]) -> jax.Array:
        if "target" in batch:
            return loss_fn(trainable, frozen, model_cfg, config, batch, remat=remat, objective=fn)
        return on_the_fly_loss(trainable, frozen, model_cfg, config, batch, remat=remat, objective=fn)

    return loss
