"""LookaheadKV's training losses over the prompt positions: KL(ŝ_GT || ŝ_LKV) (policies.md §11.4, the
default) and `topk_loss`, a ranking loss on the target's top entries (an ablation: eviction keeps a top set
and ignores the rest of the distribution)."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kvjax.lookahead.attention import check_positions, join_prompt_cache, predicted_attention, prompt_cache
from kvjax.lookahead.config import LookaheadConfig
from kvjax.models.config import ModelConfig

LOG_FLOOR = 1e-10  # predicted probabilities are clamped here inside the log
LOSSES = ("kl", "topk")

Objective = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (target, predicted, prompt_mask) -> scalar


def _row_mean(per_head: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """per_head [L,B,Hq] -> the mean over layers and heads, then over the rows that have a prompt slot."""
    rows = jnp.any(prompt_mask, axis=-1)  # [B]
    per_row = jnp.mean(per_head, axis=(0, 2))
    return jnp.sum(jnp.where(rows, per_row, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


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
    return _row_mean(kl, prompt_mask)


def topk_loss(target: jax.Array, predicted: jax.Array, prompt_mask: jax.Array, fraction: float = 0.25) -> jax.Array:
    """A ranking loss on the top entries: -log of the predicted mass (normalised over the prompt slots)
    that falls on the target's top k = ceil(fraction x prompt length) slots of each row, layer and head,
    i.e. the set an eviction keeping that fraction would keep. Slots tied with the k-th target value
    count as top. The mass is clamped at 1e-10 inside the log; no term orders the entries within the top
    set or outside it.

    target, predicted [L,B,Hq,C]; prompt_mask [B,C] bool; fraction in (0, 1]. Averaged as `kl_loss`.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk_loss fraction must be in (0, 1], got {fraction!r}")
    m = prompt_mask[None, :, None, :]
    t = jnp.where(m, target.astype(jnp.float32), -jnp.inf)
    p = jnp.where(m, predicted.astype(jnp.float32), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    lengths = jnp.sum(prompt_mask, axis=-1)  # [B]
    k = jnp.clip(jnp.ceil(fraction * lengths).astype(jnp.int32), 1, t.shape[-1])
    ranked = -jnp.sort(-t, axis=-1)  # descending
    kth = jnp.take_along_axis(ranked, jnp.broadcast_to((k - 1)[None, :, None, None], t.shape[:-1] + (1,)), axis=-1)
    top = m & (t >= kth)
    mass = jnp.sum(jnp.where(top, p, 0.0), axis=-1)  # [L,B,Hq]
    return _row_mean(-jnp.log(jnp.maximum(mass, LOG_FLOOR)), prompt_mask)


def objective(loss: str = "kl", topk_fraction: float = 0.25) -> Objective:
    """The training objective by name: "kl" (`kl_loss`) or "topk" (`topk_loss` at `topk_fraction`)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if loss == "kl":
        return kl_loss
    if not 0.0 < topk_fraction <= 1.0 or math.isnan(topk_fraction):
        raise ValueError(f"topk_fraction must be in (0, 1], got {topk_fraction!r}")
    return functools.partial(topk_loss, fraction=float(topk_fraction))


def loss_fn(adapter_params: dict[str, Any], model_params: dict[str, Any], model_cfg: ModelConfig,
            config: LookaheadConfig, batch: dict[str, jax.Array], *, remat: bool = False,
            objective: Objective = kl_loss) -> jax.Array:
    """The training loss of one batch: frozen prompt prefill (no gradient), the lookahead rows
    (gradient w.r.t. adapter_params only), then `objective` (`kl_loss`, or `topk_loss` by `objective()`)
    against batch["target"].

    batch: tokens [B,T] int32, positions [B,T] int32 (right-padded, -1 = pad), target [L,B,Hq,T]
    float32 over the L = num_global_layers layers (`response_attention` over the same prompt cache), and
    optionally the prompt cache itself (`split_prompt_cache`'s arrays: prompt_k, prompt_v [L,B,Hkv,T,D], ...),
    which then replaces the prefill. T + n_tokens must fit the model's
    positions (checked on the padded width T). remat: rematerialise the lookahead pass's layers
    in the backward pass (saves memory on long prompts).
    """
    tokens, positions, target = batch["tokens"], batch["positions"], batch["target"]
    check_positions(model_cfg, tokens.shape[1], config)
    model_params = jax.lax.stop_gradient(model_params)
    if "prompt_k" in batch:  # the targets stage stored the prefill's cache (`targets.prompt_cache`)
        cache = jax.lax.stop_gradient(join_prompt_cache(batch, positions))
    else:
        cache = jax.lax.stop_gradient(prompt_cache(model_params, model_cfg, tokens, positions))
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    predicted = predicted_attention(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat)
    return objective(jax.lax.stop_gradient(target), predicted, positions >= 0)
