"""LookaheadKV's training loss (policies.md §11.4): KL(ŝ_GT || ŝ_LKV) over the prompt positions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.lookahead.attention import check_positions, predicted_attention, prompt_cache
from kvjax.lookahead.config import LookaheadConfig
from kvjax.models.config import ModelConfig

LOG_FLOOR = 1e-10  # predicted probabilities are clamped here inside the log


def kl_loss(target: jax.Array, predicted: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """Forward KL(ŝ_target || ŝ_predicted), both normalised to sum 1 over the prompt slots.

    target, predicted [L,B,Hq,C]; prompt_mask [B,C] bool. The predicted distribution is clamped at
    1e-10 inside the log. Averaged over layers, query heads and the rows that have a prompt slot.
    Returns a float32 scalar.
    """
    m = prompt_mask[None, :, None, :]
    t = jnp.where(m, target.astype(jnp.float32), 0.0)
    p = jnp.where(m, predicted.astype(jnp.float32), 0.0)
    t = t / jnp.maximum(jnp.sum(t, axis=-1, keepdims=True), 1e-30)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    pos = m & (t > 0)
    log_t = jnp.log(jnp.where(pos, t, 1.0))
    log_p = jnp.log(jnp.maximum(jnp.where(pos, p, 1.0), LOG_FLOOR))
    kl = jnp.sum(jnp.where(pos, t * (log_t - log_p), 0.0), axis=-1)  # [L,B,Hq]
    rows = jnp.any(prompt_mask, axis=-1)  # [B]
    per_row = jnp.mean(kl, axis=(0, 2))
    return jnp.sum(jnp.where(rows, per_row, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


def loss_fn(adapter_params: dict[str, Any], model_params: dict[str, Any], model_cfg: ModelConfig,
            config: LookaheadConfig, batch: dict[str, jax.Array], *, remat: bool = False) -> jax.Array:
    """The training loss of one batch: frozen prompt prefill (no gradient), the lookahead rows
    (gradient w.r.t. adapter_params only), then `kl_loss` against batch["target"].

    batch: tokens [B,T] int32, positions [B,T] int32 (right-padded, -1 = pad), target [L,B,Hq,T]
    float32 over the L = num_global_layers layers (`response_attention` over the same prompt cache). T + n_tokens must fit the model's
    positions (checked on the padded width T). remat: rematerialise the lookahead pass's layers
    in the backward pass (saves memory on long prompts).
    """
    tokens, positions, target = batch["tokens"], batch["positions"], batch["target"]
    check_positions(model_cfg, tokens.shape[1], config)
    model_params = jax.lax.stop_gradient(model_params)
    cache = jax.lax.stop_gradient(prompt_cache(model_params, model_cfg, tokens, positions))
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    predicted = predicted_attention(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat)
    return kl_loss(jax.lax.stop_gradient(target), predicted, positions >= 0)
