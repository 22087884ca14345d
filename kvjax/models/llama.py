"""The layer math of the Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3
text) over a params pytree: norms, projections with their LoRA hook, embedding and output head.
`kvjax.models.forward.extend` puts these together with the cache and attention.

Params pytree (weights stored `[in, out]`, layers stacked on a leading L axis):
  embed [V, E]; final_norm [E]; lm_head [E, V] (absent when tied)
  layers: input_norm [L,E], post_norm [L,E], q [L,E,Hq*D], k/v [L,E,Hkv*D], o [L,Hq*D,E],
          optional q_bias/k_bias/v_bias, o_bias, q_norm/k_norm [L,D],
          gate/up [L,E,F], down [L,F,E], optional gate_bias/up_bias/down_bias;
          Gemma: post_attn_norm, post_mlp_norm [L,E] (on the attention / MLP outputs; post_norm is
          the norm before the MLP, as for Llama)

Gemma 2 / Gemma 3 (`cfg.gemma`) reuse the same layer with Gemma's norms, scales and soft-caps
(kvjax.models.gemma).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.kernels.attention import softcap
from kvjax.models import gemma
from kvjax.models.config import ModelConfig

Params = dict[str, Any]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b


def _lora(y: jax.Array, x: jax.Array, name: str, hook: dict[str, Any] | None) -> jax.Array:
    """y + mask * scale * (x A) B on the hook's rows only; other rows are returned bit-identical.

    x [B,n,in], y [B,n,out]; hook: {"lora": {name: {"a": [in,r], "b": [r,out]}} (this layer's slice),
    "mask": [B,n] bool, "scale": float}. Projections absent from hook["lora"] are left alone.
    """
    if hook is None or name not in hook["lora"]:
        return y
    f = hook["lora"][name]
    delta = (x.astype(jnp.float32) @ f["a"].astype(jnp.float32)) @ f["b"].astype(jnp.float32)
    return jnp.where(hook["mask"][..., None], y + (hook["scale"] * delta).astype(y.dtype), y)


def _norm_fn(cfg: ModelConfig):
    return gemma.gemma_rms_norm if cfg.gemma else rms_norm


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Input vectors [B,n,E] of token ids [B,n] (Gemma's sqrt(hidden) scaling included)."""
    h = params["embed"][tokens].astype(cfg.jnp_dtype)
    return h * gemma.embed_scale(cfg) if cfg.gemma else h


def layer_qkv(cfg: ModelConfig, lp: Params, h: jax.Array, hook: dict[str, Any] | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's un-rotated queries [B,Hq,n,D], keys and values [B,Hkv,n,D] of the residual stream
    h [B,n,E] (input norm, projections with their optional bias, LoRA hook and q/k norm). `lp` is that
    layer's slice of params["layers"]."""
    B, n, _ = h.shape
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm, eps = _norm_fn(cfg), cfg.rms_norm_eps
    x = norm(h, lp["input_norm"], eps)
    q = _lora(_linear(x, lp["q"], lp.get("q_bias")), x, "q", hook).reshape(B, n, Hq, D).transpose(0, 2, 1, 3)
    k = _lora(_linear(x, lp["k"], lp.get("k_bias")), x, "k", hook).reshape(B, n, Hkv, D).transpose(0, 2, 1, 3)
    v = _lora(_linear(x, lp["v"], lp.get("v_bias")), x, "v", hook).reshape(B, n, Hkv, D).transpose(0, 2, 1, 3)
    if cfg.qk_norm:
        q = norm(q, lp["q_norm"], eps)
        k = norm(k, lp["k_norm"], eps)
    return q, k, v


def layer_finish(cfg: ModelConfig, lp: Params, h: jax.Array, out: jax.Array, hook: dict[str, Any] | None = None
                 ) -> jax.Array:
    """The residual stream after one layer: h [B,n,E] plus the output projection of the attention
    output out [B,Hq,n,D], then plus the MLP (Gemma's post-norms included)."""
    B, _, n, _ = out.shape
    norm, eps = _norm_fn(cfg), cfg.rms_norm_eps
    act_fn = (lambda x: jax.nn.gelu(x, approximate=True)) if cfg.hidden_act == "gelu_pytorch_tanh" else jax.nn.silu
    attn = out.transpose(0, 2, 1, 3).reshape(B, n, -1)
    attn_out = _lora(_linear(attn, lp["o"], lp.get("o_bias")), attn, "o", hook)
    h = h + (norm(attn_out, lp["post_attn_norm"], eps) if cfg.gemma else attn_out)
    x = norm(h, lp["post_norm"], eps)
    gate = _lora(_linear(x, lp["gate"], lp.get("gate_bias")), x, "gate", hook)
    up = _lora(_linear(x, lp["up"], lp.get("up_bias")), x, "up", hook)
    act = act_fn(gate) * up
    mlp = _lora(_linear(act, lp["down"], lp.get("down_bias")), act, "down", hook)
    return h + (norm(mlp, lp["post_mlp_norm"], eps) if cfg.gemma else mlp)


def output_logits(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """float32 logits [B,k,V] of the final residual stream h [B,k,E] (final norm, head, soft-cap)."""
    h = _norm_fn(cfg)(h, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.einsum("bne,ev->bnv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
    return softcap(logits, cfg.final_logit_softcapping)
