"""LookaheadKV's attention quantities (policies.md §11.1, §11.3), computed with the model's `extend`.

Shapes: L global layers (`cfg.num_global_layers`: every layer of a Llama-family model; Gemma 2 / 3's
sliding-window layers need no eviction, and observations cover the global layers only), B rows, Hq
query heads, C cache slots, n lookahead tokens, Y response tokens. The prompt cache is a frozen
prefill's `KVCache` ([L,B,Hkv,C,D], plus rolling buffers for sliding-window layers: `prompt_cache`);
row b's prompt has `lengths[b]` tokens at positions 0 .. lengths[b]-1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.lookahead.config import LookaheadConfig
from kvjax.models.config import ModelConfig
from kvjax.models.forward import RidingRows, extend
from kvjax.models.local import init_cache
from kvjax.observations import ObservationSpec

RESPONSE_CHUNK = 128  # response tokens fed per step in `response_attention`


def check_positions(cfg: ModelConfig, prompt_tokens: int, config: LookaheadConfig) -> None:
    """ValueError when the lookahead tokens after a prompt of `prompt_tokens` tokens pass the model's positions."""
    need = int(prompt_tokens) + config.offsets[-1] + 1
    if need > cfg.max_position_embeddings:
        spread = "" if config.span is None else f" spread over span={config.span}"
        raise ValueError(
            f"a prompt of {int(prompt_tokens)} tokens plus n_tokens={config.n_tokens} lookahead tokens{spread} needs "
            f"{need} positions, more than the model allows (max_position_embeddings={cfg.max_position_embeddings})")


def prompt_cache(model_params: dict[str, Any], model_cfg: ModelConfig, tokens: jax.Array,
                 positions: jax.Array) -> KVCache:
    """The frozen prefill's cache of right-padded prompts tokens/positions [B,T] (slot i = token i):
    capacity T on each global layer ([L,B,Hkv,T,D]), and for a model with sliding-window layers
    their rolling buffers (`kvjax.models.local.init_cache`)."""
    B, T = tokens.shape
    cache = init_cache(model_cfg, B, T)
    _, cache, _ = extend(model_params, model_cfg, cache, tokens, positions, fresh=True,
                         logit_index=jnp.zeros((B, 0), jnp.int32))  # no logits
    return cache


# the arrays that store a prompt cache (`split_prompt_cache`), each with the batch on axis 1; the global
# layers' (prompt_k, prompt_v) have slot i = token i on axis 3, the rolling buffers' a fixed window
PROMPT_CACHE_GLOBAL = ("prompt_k", "prompt_v")
PROMPT_CACHE_LOCAL = ("prompt_local_k", "prompt_local_v", "prompt_local_pos", "prompt_local_valid")


def split_prompt_cache(cache: KVCache) -> dict[str, jax.Array]:
    """`prompt_cache`'s result as the arrays that rebuild it (`join_prompt_cache`): prompt_k, prompt_v
    [L,B,Hkv,T,D], and for a model with sliding-window layers their rolling buffers prompt_local_k,
    prompt_local_v [Ll,B,Hkv,W,D], prompt_local_pos, prompt_local_valid [Ll,B,Hkv,W]. The global layers'
    pos and valid are not stored: slot i holds token i, so the prompts' positions give them."""
    out = {"prompt_k": cache.k, "prompt_v": cache.v}
    if cache.local is not None:
        out.update(prompt_local_k=cache.local.k, prompt_local_v=cache.local.v, prompt_local_pos=cache.local.pos,
                   prompt_local_valid=cache.local.valid)
    return out


def join_prompt_cache(arrays: dict[str, jax.Array], positions: jax.Array) -> KVCache:
    """The `KVCache` `prompt_cache(params, cfg, tokens, positions)` returns, from `split_prompt_cache`'s
    arrays (as they come in a batch) and the prompts' positions [B,T] (right-padded, -1 = pad)."""
    k = arrays["prompt_k"]
    L, B, H, T, _ = k.shape
    if positions.shape != (B, T):
        raise ValueError(f"positions {positions.shape} do not match the stored prompt cache's [B, T] = {(B, T)}")
    pos = jnp.broadcast_to(positions[None, :, None, :], (L, B, H, T)).astype(jnp.int32)
    cache = KVCache(k=k, v=arrays["prompt_v"], pos=pos, valid=pos >= 0)
    if "prompt_local_k" in arrays:
        cache = cache.replace(local=KVCache(k=arrays["prompt_local_k"], v=arrays["prompt_local_v"],
                                            pos=arrays["prompt_local_pos"], valid=arrays["prompt_local_valid"]))
    return cache


def adapter_hook(adapter_params: dict[str, Any], config: LookaheadConfig, mask: jax.Array) -> dict[str, Any]:
    """The row-masked LoRA hook `extend` takes: the factors, the row mask [B,n] and alpha / rank."""
    lora = {p: adapter_params["lora"][p] for p in config.projections}
    return {"lora": lora, "mask": mask, "scale": config.scale}


def lookahead_mass(model_params: dict[str, Any], model_cfg: ModelConfig, adapter_params: dict[str, Any],
                   config: LookaheadConfig, cache: KVCache, lengths: jax.Array, *, remat: bool = False,
                   differentiable: bool = False) -> jax.Array:
    """Runs the n learned tokens (LoRA on their rows) at positions lengths + config.offsets against
    `cache` without storing them; returns their attention mass per query head over the cache slots,
    summed over the n tokens: [L,B,Hq,C] float32 (the softmax includes the tokens' own causal keys).
    remat: rematerialise each layer in the backward pass (long prompts in training).
    differentiable: attention in every layer is reverse-differentiable (training; `extend`'s flag)."""
    return lookahead_observations(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat,
                                  differentiable=differentiable)["query_mass"]


def lookahead_observations(model_params: dict[str, Any], model_cfg: ModelConfig, adapter_params: dict[str, Any],
                           config: LookaheadConfig, cache: KVCache, lengths: jax.Array, *, moments: bool = False,
                           remat: bool = False, differentiable: bool = False) -> dict[str, jax.Array]:
    """`lookahead_mass`'s pass, returning its observations by field: query_mass, and with `moments`
    also query_sumsq and query_entropy ([L,B,Hq,C] float32 each, `kvjax.observations.query_moments`:
    the second moment and the entropy terms of the n tokens' attention, for CAKE's layer preference)."""
    if not isinstance(lengths, jax.core.Tracer):
        check_positions(model_cfg, int(jnp.max(lengths)), config)
    rows = lookahead_rows(model_cfg, adapter_params, config, lengths, moments=moments)
    _, _, obs = extend(model_params, model_cfg, cache, None, rows.positions, fresh=False, commit=False,
                       observe=rows.observe, inputs_embeds=rows.embeds, adapter=rows.adapter,
                       logit_index=jnp.zeros((lengths.shape[0], 0), jnp.int32), remat=remat,
                       differentiable=differentiable)
    return {f: getattr(obs, f) for f in lookahead_fields(moments)}


def lookahead_fields(moments: bool) -> tuple[str, ...]:
    """The fields the lookahead tokens record: query_mass, and with `moments` query_sumsq and query_entropy."""
    return ("query_mass", "query_sumsq", "query_entropy") if moments else ("query_mass",)


def lookahead_rows(model_cfg: ModelConfig, adapter_params: dict[str, Any], config: LookaheadConfig,
                   lengths: jax.Array, *, moments: bool = False) -> RidingRows:
    """The n lookahead tokens after prompts of `lengths` [B] tokens, as rows for `extend`: their input
    vectors [B,n,E] (the learned embeddings), positions lengths + config.offsets [B,n], the LoRA hook on
    every one of their rows, and what they record (`lookahead_fields`). Run against a finished prefill's
    cache (`lookahead_observations`) or riding the prefill itself (`extend(..., riding=...)`): the same values."""
    B, n = lengths.shape[0], config.n_tokens
    positions = (lengths[:, None] + jnp.asarray(config.offsets, jnp.int32)[None]).astype(jnp.int32)
    embeds = jnp.broadcast_to(adapter_params["embeddings"][None], (B, n, model_cfg.hidden_size))
    return RidingRows(embeds=embeds, positions=positions,
                      adapter=adapter_hook(adapter_params, config, jnp.ones((B, n), bool)),
                      observe=ObservationSpec(query_mass=True, query_moments=moments))


def predicted_attention(model_params: dict[str, Any], model_cfg: ModelConfig, adapter_params: dict[str, Any],
                        config: LookaheadConfig, cache: KVCache, lengths: jax.Array, *,
                        remat: bool = False) -> jax.Array:
    """s̃ (§11.3): per query head, the mean over the n lookahead queries of their attention
    probabilities over the cache slots (softmax over prompt + causal lookahead keys, then restricted
    to the prompt slots; empty slots 0). [L,B,Hq,C] float32, differentiable w.r.t. adapter_params
    (through every layer, sliding-window layers included)."""
    mass = lookahead_mass(model_params, model_cfg, adapter_params, config, cache, lengths, remat=remat,
                          differentiable=True)
    return mass / config.n_tokens


def response_attention(model_params: dict[str, Any], model_cfg: ModelConfig, cache: KVCache,
                       response_tokens: jax.Array, response_positions: jax.Array, *,
                       chunk: int = RESPONSE_CHUNK) -> jax.Array:
    """s_GT (§11.1): per query head, the mean over each row's real response tokens of their attention
    probabilities over the prompt slots of `cache` ([L,B,Hq,C] float32 over the L = num_global_layers
    layers the cache holds; 0 on empty slots, and for a row without response tokens).

    response_tokens [B,Y] int32, response_positions [B,Y] int32 (-1 = padding; a real response
    token continues the prompt, at lengths[b] + t). The response runs as a continuation against the
    prompt cache, `chunk` tokens per step, so no [T+Y, T+Y] matrix exists.
    """
    B, Y = response_tokens.shape
    C = cache.capacity
    chunk = max(1, min(int(chunk), Y))
    steps = -(-Y // chunk)
    pad = steps * chunk - Y
    tokens = jnp.pad(response_tokens, ((0, 0), (0, pad)))
    positions = jnp.pad(response_positions, ((0, 0), (0, pad)), constant_values=-1)
    prompt = cache.valid[0, :, 0]  # [B, C]: the prompt slots (same for every layer and head after prefill)
    grown = cache.grow(C + steps * chunk)
    tok = tokens.reshape(B, steps, chunk).transpose(1, 0, 2)
    pos = positions.reshape(B, steps, chunk).transpose(1, 0, 2)

    def one(carry, xs):
        grown, acc = carry
        t, p = xs
        _, grown, obs = extend(model_params, model_cfg, grown, t, p, fresh=False,
                               observe=ObservationSpec(query_mass=True), logit_index=jnp.zeros((B, 0), jnp.int32))
        return (grown, acc + obs.query_mass[..., :C]), None

    acc0 = jnp.zeros((model_cfg.num_global_layers, B, model_cfg.num_heads, C), jnp.float32)
    (_, acc), _ = jax.lax.scan(one, (grown, acc0), (tok, pos))
    count = jnp.sum(response_positions >= 0, axis=-1).astype(jnp.float32)  # [B]
    out = acc / jnp.maximum(count, 1.0)[None, :, None, None]
    return jnp.where(prompt[None, :, None, :], out, 0.0)
