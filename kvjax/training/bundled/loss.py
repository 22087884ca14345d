"""The bundled model's loss: cross-entropy on the answer tokens, plus language modelling of the prompts."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.models.config import ModelConfig
from kvjax.models.forward import extend


def lm_loss(params: Any, frozen: Any, batch: dict[str, jax.Array], *, cfg: ModelConfig,
            context_weight: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy on the answer tokens, plus `context_weight` x the mean over
    every other real token (plain language modelling of the prompts: the haystacks, needle lines and
    questions repeat keys and values, which is what grows copying heads early). Metrics: the two
    losses and answer-token accuracy."""
    logits, _, _ = extend(params, cfg, None, batch["tokens"], batch["positions"], fresh=True,
                          logit_index=None if context_weight else batch["target_index"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    if context_weight:
        ans_logp = jnp.take_along_axis(logp, batch["target_index"][..., None], axis=1)
        tokens = batch["tokens"]
        nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        nll_all = -jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
        cw = batch["context_weights"]
        context_nll = (nll_all * cw).sum() / jnp.maximum(cw.sum(), 1.0)
    else:
        ans_logp, context_nll = logp, jnp.float32(0.0)
    nll = -jnp.take_along_axis(ans_logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    acc = ((jnp.argmax(ans_logp, -1) == batch["targets"]) * w).sum() / denom
    answer_nll = (nll * w).sum() / denom
    return answer_nll + context_weight * context_nll, {"answer_token_accuracy": acc, "answer_loss": answer_nll,
                                                        "context_loss": context_nll}

