"""The training loss for both target modes (policies.md §11.4).

Stored targets: kvjax.lookahead.loss_fn. On-the-fly targets: one frozen prompt prefill (under
stop_gradient) serves two continuations against its cache: the response (no gradient), reduced to
s_GT by kvjax.lookahead.response_attention, and the lookahead rows (with gradient), giving s̃;
then kvjax.lookahead.kl_loss.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.lookahead import LookaheadConfig, kl_loss, loss_fn, predicted_attention, prompt_cache, response_attention
from kvjax.models.config import ModelConfig


def on_the_fly_loss(adapter_params: Any, model_params: Any, model_cfg: ModelConfig, config: LookaheadConfig,
                    batch: dict[str, jax.Array], *, remat: bool = False) -> jax.Array:
    """batch: tokens / positions [B, T], response / response_positions [B, Y] (-1 = pad)."""
    tokens, positions = batch["tokens"], batch["positions"]
    model_params = jax.lax.stop_gradient(model_params)
    cache = jax.lax.stop_gradient(prompt_cache(model_params, model_cfg, tokens, positions))
    target = jax.lax.stop_gradient(response_attention(model_params, model_cfg, cache, batch["response"],
                                                      batch["response_positions"]))
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    predicted = predicted_attention(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat)
    return kl_loss(target, predicted, positions >= 0)


@functools.cache
def lookahead_loss(model_cfg: ModelConfig, config: LookaheadConfig, remat: bool = False):
    """loss(trainable, frozen, batch) for the train loop: stored targets when the batch has "target".
    One function per (model config, lookahead config), so the train loop's compiled step is reused."""

    def loss(trainable: Any, frozen: Any, batch: dict[str, jax.Array]) -> jax.Array:
        if "target" in batch:
            return loss_fn(trainable, frozen, model_cfg, config, batch, remat=remat)
        return on_the_fly_loss(trainable, frozen, model_cfg, config, batch, remat=remat)

    return loss
