"""Functional Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 text)
over a params pytree.

One function, `extend`, runs `n` new tokens through the model against a `KVCache`: a prefill is
`extend` on an empty cache (`fresh=True`), a question chunk or a decode step is `extend` on a
filled one. Layers are stacked `[L, ...]` and run under `lax.scan`; GQA queries are reshaped to
`[B, Hkv, G, n, D]`, keys and values are never repeated.

Params pytree (weights stored `[in, out]`, layers stacked on a leading L axis):
  embed [V, E]; final_norm [E]; lm_head [E, V] (absent when tied)
  layers: input_norm [L,E], post_norm [L,E], q [L,E,Hq*D], k/v [L,E,Hkv*D], o [L,Hq*D,E],
          optional q_bias/k_bias/v_bias, o_bias, q_norm/k_norm [L,D],
          gate/up [L,E,F], down [L,F,E], optional gate_bias/up_bias/down_bias;
          Gemma: post_attn_norm, post_mlp_norm [L,E] (on the attention / MLP outputs; post_norm is
          the norm before the MLP, as for Llama)

Gemma 2 / Gemma 3 (`cfg.gemma`) reuse the same layer with Gemma's norms, scales and soft-caps
(kvjax.models.gemma). Their sliding-window layers attend over a rolling buffer of W slots
(kvjax.models.local) carried in `KVCache.local`; the layer stack still runs under one `lax.scan`,
with a `lax.cond` choosing the local or the global attention of each layer, and only the global
layers have observations and a slot in the policy-visible cache.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import kernels
from kvjax.cache import KVCache
from kvjax.kernels._common import masked_softmax, resolve_implementation
from kvjax.models import gemma
from kvjax.models.attention import prefill_attention
from kvjax.models.config import ModelConfig
from kvjax.models.local import layer_plan, rolling_write
from kvjax.models.rope import apply_rope, inverse_frequencies, local_inverse_frequencies, rope_tables, slot_ranks
from kvjax.observations import Observations, ObservationSpec

# The spec of what `extend` records for the policies (kept under its historical name).
Observe = ObservationSpec

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


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float,
    *, window: int | None = None, softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention by position over masked slots.

    q [B,Hq,n,D], k/v [B,Hkv,S,D], q_pos [B,n] (-1 = padding query), k_pos [B,Hkv,S] (-1 = empty).
    Query i sees slot s iff 0 <= k_pos[s] <= q_pos[i] (and q_pos[i] - k_pos[s] < window when given).
    softcap: logits -> softcap * tanh(logits / softcap) before masking (Gemma 2).
    Returns out [B,Hq,n,D] (q dtype) and probs [B,Hkv,G,n,S] float32.
    """
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, n, D)
    logits = jnp.einsum("bhgnd,bhsd->bhgns", qg, k, preferred_element_type=jnp.float32) * scale
    logits = gemma.softcap(logits, softcap)
    mask = (k_pos[:, :, None, None, :] >= 0) & (k_pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    if window is not None:
        mask &= k_pos[:, :, None, None, :] > q_pos[:, None, None, :, None] - window
    probs = masked_softmax(logits, mask)
    out = jnp.einsum("bhgns,bhsd->bhgnd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(B, Hq, n, D), probs


def attend_blocked(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, scale: float, block: int,
    column_mass: bool = False, *, window: int | None = None, softcap: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`attend` over query blocks of `block` rows, so no `[n, S]` score matrix exists at once.

    Returns out [B,Hq,n,D] and, when asked, the column mass [B,Hkv,S] float32: for every key, the
    attention probability summed over all valid queries and over the query group.
    """
    B, Hq, n, D = q.shape
    nb = n // block
    qb = q.reshape(B, Hq, nb, block, D).transpose(2, 0, 1, 3, 4)
    pb = q_pos.reshape(B, nb, block).transpose(1, 0, 2)

    def one(mass, xs):
        qi, pi = xs
        out, probs = attend(qi, k, v, pi, k_pos, scale, window=window, softcap=softcap)
        if column_mass:  # padding queries see no key, so their probability rows are already zero
            mass = mass + jnp.sum(probs, axis=(2, 3))
        return mass, out

    mass0 = jnp.zeros(k.shape[:3], jnp.float32)
    mass, out = jax.lax.scan(one, mass0, (qb, pb))
    out = out.transpose(1, 2, 0, 3, 4).reshape(B, Hq, n, D)
    return out, (mass if column_mass else None)


QUERY_BLOCK = 1024  # prefills longer than this attend in query blocks (when probabilities are materialised)
# False: every chunk attends with materialised probabilities (`attend`, `attend_blocked`), as before the
# flash path existed; the reference the tests compare the flash path with. Read when `extend` is traced.
FLASH_ATTENTION = True
OUTPUT_NORM_BLOCK = 128  # keys per block of the output-norm observation ([B,Hq,block,E] at once)


def output_norms(v: jax.Array, wo: jax.Array, real: jax.Array) -> jax.Array:
    """CriticalKV's per-key output weight: the group mean of ||v_j W_o^h||_1, float32 [B,Hkv,n].

    v [B,Hkv,n,D]; wo [Hq*D,E] (the output projection, rows of query head h at h*D:(h+1)*D);
    real [B,n] bool (padding keys get 0). Keys go through in blocks, so [B,Hq,block,E] is the
    largest intermediate.
    """
    B, Hkv, n, D = v.shape
    E = wo.shape[-1]
    G = wo.shape[0] // (Hkv * D)
    w = wo.reshape(Hkv, G, D, E)
    block = min(n, OUTPUT_NORM_BLOCK)
    nb = -(-n // block)
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, nb * block - n), (0, 0))).reshape(B, Hkv, nb, block, D)

    def one(vb):  # [B,Hkv,block,D] -> [B,Hkv,block]
        proj = jnp.einsum("bhcd,hgde->bhgce", vb, w.astype(vb.dtype), preferred_element_type=jnp.float32)
        return jnp.abs(proj).sum(-1).mean(2)

    out = jax.lax.map(one, vp.transpose(2, 0, 1, 3, 4))  # [nb,B,Hkv,block]
    out = out.transpose(1, 2, 0, 3).reshape(B, Hkv, nb * block)[:, :, :n]
    return jnp.where(real[:, None, :], out, 0.0)


def query_statistics(q: jax.Array, positions: jax.Array, start: int) -> tuple[jax.Array, jax.Array]:
    """Mean [B,Hq,D] and biased covariance [B,Hq,D,D] (float32) of the queries q [B,Hq,n,D] at the
    real positions >= start (positions [B,n], -1 = padding). A row with no such query gets zeros."""
    sel = ((positions >= start) & (positions >= 0)).astype(jnp.float32)  # [B,n]
    count = jnp.maximum(sel.sum(-1), 1.0)[:, None, None]
    qf = q.astype(jnp.float32)
    mean = jnp.einsum("bhnd,bn->bhd", qf, sel) / count
    centered = (qf - mean[:, :, None, :]) * sel[:, None, :, None]
    cov = jnp.einsum("bhnd,bhne->bhde", centered, centered) / count[..., None]
    return mean, cov


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
    return gemma.softcap(logits, cfg.final_logit_softcapping)


def extend(
    params: Params,
    cfg: ModelConfig,
    cache: KVCache | None,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    fresh: bool,
    observe: ObservationSpec = ObservationSpec(),
    logit_index: jax.Array | None = None,
    slots: jax.Array | None = None,
    remat: bool = False,
    rope_mode: str = "original",
    inputs_embeds: jax.Array | None = None,
    adapter: dict[str, Any] | None = None,
    commit: bool = True,
) -> tuple[jax.Array, KVCache, Observations]:
    """Runs `n` new tokens through the model, writing their keys/values into `cache`.

    tokens [B,n] int32; positions [B,n] int32 absolute positions (-1 = padding, never attended or kept).
    fresh: the cache is empty and the tokens go to slots 0..n-1 (a prefill); attention then reads
      only the new keys. Otherwise they go to each head's first free slots and attend to the cache.
      `cache=None` (fresh only) runs without a cache, as in training; the returned cache is None.
    observe: what to record for the policies (`ObservationSpec`); window queries are those of the
      last `observe.window` real tokens of each row (tokens are right-padded).
    logit_index [B,k]: indices of the tokens whose logits are returned (all tokens when None).
    slots [L,B,Hkv,n]: where the new tokens are written (default: `cache.write_slots(n)`).
    remat: rematerialise each layer in the backward pass (training).
    rope_mode: "original", or "cache_relative" (StreamingLLM): keys are cached un-rotated; a filled
      cache is attended with every kept key rotated at its rank among the kept slots of its head,
      and each new query at the rank of its own slot. A prefill is the same either way.
    inputs_embeds [B,n,E]: input vectors used instead of `embed[tokens]` (tokens may then be None;
      Gemma's sqrt(hidden) scaling applies to token embeddings only, as in HF).
    adapter: a row-masked low-rank hook (LookaheadKV): {"lora": {proj: {"a": [L,in,r], "b": [L,r,out]}},
      "mask": [B,n] bool, "scale": float}; proj in q,k,v,o,gate,up,down. Rows where mask is False
      compute exactly what they compute without the hook (bit-identical).
    commit: False (with fresh=False, rope_mode "original") attends the new tokens to the cache plus
      their own keys (causal by position) without writing them: the returned cache is `cache` itself.
    Returns logits [B,n or k,V] float32, the updated cache, and the `Observations` asked for:
      window_queries [L,B,Hq,w,D], column_mass [L,B,Hkv,C] f32, step_probs [L,B,Hkv,G,C] f32,
      query_mass [L,B,Hq,C] f32 (cache slots only; not for blocked prefills).

    Attention: with a cache, a chunk of n > 1 tokens attends by `kvjax.models.attention.prefill_attention`
    (blocked flash attention that visits only the key blocks its queries can see, or splash attention
    on TPU; forward only, not reverse-differentiable) unless an observation reads the probabilities
    (query_mass, step_probs, a chunk's column mass, a soft-capped prefill's column mass); those, one
    token, and calls without a cache (training, differentiable) materialise them (`attend`).

    Models with sliding-window layers (Gemma): L above is `cfg.num_global_layers`, the cache comes from
    `kvjax.models.local.init_cache` (its `local` rolling buffers are updated here, rope_mode aside:
    local layers always keep keys at their original rotation), and the real tokens of each row must
    have distinct positions (contiguous, as the engine feeds them).
    """
    B, n = positions.shape
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    dtype = cfg.jnp_dtype
    scale = cfg.attn_scale
    cap = cfg.attn_logit_softcapping
    has_local = bool(cfg.local_layer_ids)
    if rope_mode not in ("original", "cache_relative"):
        raise ValueError(f"rope_mode={rope_mode!r}; accepted values: 'original', 'cache_relative'")
    relative = rope_mode == "cache_relative"
    inv_freq = inverse_frequencies(cfg)
    cos, sin = rope_tables(jnp.maximum(positions, 0), inv_freq, dtype)
    if cache is None and not fresh:
        raise ValueError("extend: cache=None needs fresh=True")
    if not commit and (fresh or relative):
        raise ValueError("extend: commit=False needs fresh=False and rope_mode='original'")
    if cache is not None and (cache.k.shape[0] != cfg.num_global_layers or has_local != (cache.local is not None)):
        raise ValueError(f"extend: the cache has {cache.k.shape[0]} layers and local buffers: "
                         f"{cache.local is not None}; this {cfg.family} model needs {cfg.num_global_layers} global "
                         f"layers and local buffers: {has_local} (build it with kvjax.models.local.init_cache)")
    if not fresh and slots is None and commit:
        slots = cache.write_slots(n)
    C = n if cache is None else cache.capacity
    if inputs_embeds is None:
        h = embed_tokens(params, cfg, tokens)
    else:
        h = inputs_embeds.astype(dtype)
    observe_any = bool(observe)
    # Observations that read attention probabilities; the others (window queries, output norms, query
    # statistics, a prefill's column mass through its two-pass kernel) leave attention to the blocked flash
    # path. Without a cache (training) attention stays differentiable, and one query (a decode step) needs
    # no blocks: the plain paths below.
    plain = not FLASH_ATTENTION or cache is None or n == 1
    needs_probs = (plain or observe.query_mass or (observe.step_probs and not fresh)
                   or (observe.column_mass and (not fresh or cap is not None)))
    n_real = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)  # [B]
    window_pos = n_real[:, None] - observe.window + jnp.arange(observe.window)  # [B, w]
    window_index = jnp.maximum(window_pos, 0)
    is_local, cache_index = layer_plan(cfg)
    if has_local:
        local_cos, local_sin = rope_tables(jnp.maximum(positions, 0), local_inverse_frequencies(cfg), dtype)

    def global_write(k_stored, v, ck, cv, cpos, cvalid, l, s, enabled=None):
        """Writes the new keys/values of a global layer into its cache `l` (slots 0..n-1 for a prefill,
        `s` otherwise). enabled (traced bool, models with local layers): False drops the write."""
        new_pos = jnp.broadcast_to(positions[:, None, :], (B, Hkv, n)).astype(jnp.int32)
        if ck is None or not commit:
            return ck, cv, cpos, cvalid
        if fresh and enabled is None:
            ck = jax.lax.dynamic_update_slice(ck, k_stored[None].astype(ck.dtype), (l, 0, 0, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (l, 0, 0, 0, 0))
            cpos = jax.lax.dynamic_update_slice(cpos, new_pos[None], (l, 0, 0, 0))
            cvalid = jax.lax.dynamic_update_slice(cvalid, (new_pos >= 0)[None], (l, 0, 0, 0))
            return ck, cv, cpos, cvalid
        if fresh:
            s = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, Hkv, n))
        mode = None
        if enabled is not None:  # an out-of-range slot drops the write
            s, mode = jnp.where(enabled, s, ck.shape[3]), "drop"
        bi, hi = jnp.meshgrid(jnp.arange(B), jnp.arange(Hkv), indexing="ij")
        idx = (l, bi[..., None], hi[..., None], s)
        ck = ck.at[idx].set(k_stored.astype(ck.dtype), mode=mode)
        cv = cv.at[idx].set(v.astype(cv.dtype), mode=mode)
        cpos = cpos.at[idx].set(new_pos, mode=mode)
        cvalid = cvalid.at[idx].set(new_pos >= 0, mode=mode)
        return ck, cv, cpos, cvalid

    def global_attention(q, q_raw, k, v, ck, cv, cpos, cvalid, l, s, wo):
        """Attention of a global layer (its new keys already written into its cache `l`, unless
        commit=False): out [B,Hq,n,D] and its observations. q, k rotated; q_raw un-rotated;
        wo [Hq*D,E] the output projection (for the output-norm observation)."""
        new_pos = jnp.broadcast_to(positions[:, None, :], (B, Hkv, n)).astype(jnp.int32)
        if fresh and ck is None and not observe_any and cap is None:
            # no cache and no observations (training): padding is on the right, so a real query sees
            # only real keys under the causal mask alone, and the fused XLA attention applies
            out = jax.nn.dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                               v.transpose(0, 2, 1, 3), scale=scale, is_causal=True)
            out, probs = out.transpose(0, 2, 1, 3), None
        elif fresh and not needs_probs:
            # no observation reads the probabilities: blocked flash attention, the causal upper triangle
            # skipped; its log-sum-exp is the first pass of the two-pass column mass
            out, lse = prefill_attention(q, k, v, positions, new_pos, scale, softcap=cap, own_keys=True)
            probs = None
            if observe.column_mass:
                mass = kernels.column_mass(q, k, positions, new_pos, scale=scale, lse=lse)
        elif fresh:
            if n > QUERY_BLOCK and n % QUERY_BLOCK == 0:
                # on TPU/GPU the column mass comes from the two-pass kernel; in XLA (or with soft-capped
                # logits, which the kernel does not apply), from the blocks' probs
                in_blocks = observe.column_mass and (resolve_implementation(None, "column_mass") == "xla"
                                                     or cap is not None)
                out, mass = attend_blocked(q, k, v, positions, new_pos, scale, QUERY_BLOCK, in_blocks, softcap=cap)
                if observe.column_mass and not in_blocks:
                    mass = kernels.column_mass(q, k, positions, new_pos, scale=scale)
                probs = None
            else:
                out, probs = attend(q, k, v, positions, new_pos, scale, softcap=cap)
        elif not commit:  # the new tokens see the cache and each other, and are not stored
            keys = jnp.concatenate([ck[l], k.astype(ck.dtype)], axis=2)
            vals = jnp.concatenate([cv[l], v.astype(cv.dtype)], axis=2)
            key_pos = jnp.concatenate([jnp.where(cvalid[l], cpos[l], -1), new_pos], axis=2)
            if needs_probs:
                out, probs = attend(q, keys, vals, positions, key_pos, scale, softcap=cap)
            else:
                out, probs = prefill_attention(q, keys, vals, positions, key_pos, scale, softcap=cap)[0], None
        else:
            keys = ck[l]
            if relative:
                ranks = slot_ranks(cvalid[l], cpos[l])  # [B, Hkv, C]
                kcos, ksin = rope_tables(ranks, inv_freq, dtype)
                keys = apply_rope(keys, kcos, ksin)
                q_rank = jnp.repeat(jnp.take_along_axis(ranks, s, axis=-1), Hq // Hkv, axis=1)  # [B, Hq, n]
                qcos, qsin = rope_tables(q_rank, inv_freq, dtype)
                q = apply_rope(q_raw, qcos, qsin)
            if n == 1 and cap is None:  # a decode step: every valid slot precedes the query; padding rows see nothing
                visible = cvalid[l] & (positions[:, :1] >= 0)[:, :, None]
                out, probs = kernels.decode_attention(q[:, :, 0], keys, cv[l], visible, scale=scale)
                out, probs = out[:, :, None], probs[:, :, :, None]
            else:
                layer_pos = jnp.where(cvalid[l], cpos[l], -1)
                if needs_probs:
                    out, probs = attend(q, keys, cv[l], positions, layer_pos, scale, softcap=cap)
                else:
                    out, probs = prefill_attention(q, keys, cv[l], positions, layer_pos, scale, softcap=cap)[0], None
        obs = {}
        if observe.window:
            obs["window_queries"] = jnp.take_along_axis(q, window_index[:, None, :, None], axis=2)
        if observe.column_mass:
            if probs is not None:  # padding queries see no key: their rows of probs are zero
                mass = jnp.sum(probs, axis=(2, 3))  # [B, Hkv, keys]
            obs["column_mass"] = jnp.pad(mass, ((0, 0), (0, 0), (0, C - mass.shape[-1]))) if fresh else mass
        if observe.step_probs and not fresh:
            obs["step_probs"] = probs[:, :, :, -1, :]
        if observe.output_norms and fresh:
            norms = output_norms(v, wo, positions >= 0)
            obs["output_norms"] = jnp.pad(norms, ((0, 0), (0, 0), (0, C - n)))
        if observe.query_stats >= 0 and fresh:
            obs["query_mean"], obs["query_cov"] = query_statistics(q_raw, positions, observe.query_stats)
        if observe.query_mass:
            if probs is None:
                raise ValueError("extend: query_mass is not recorded for blocked prefills (n > QUERY_BLOCK)")
            mass = jnp.sum(jnp.where((positions >= 0)[:, None, None, :, None], probs, 0.0), axis=3)
            mass = mass.reshape(B, Hq, -1)
            obs["query_mass"] = jnp.pad(mass, ((0, 0), (0, 0), (0, C - mass.shape[-1]))) if fresh else mass[:, :, :C]
        return out, obs

    def local_attention(q, k, v, local, li):
        """Attention of a sliding-window layer over its rolling buffer `li` (not yet written: it holds
        earlier positions only) and the new keys: out [B,Hq,n,D]. q, k rotated with the local RoPE."""
        keys, vals = k, v
        k_pos = jnp.broadcast_to(positions[:, None, :], (B, Hkv, n)).astype(jnp.int32)
        if local is not None and not fresh:
            bk, bv, bpos, bvalid = (x[li] for x in local)
            keys = jnp.concatenate([bk, k.astype(bk.dtype)], axis=2)
            vals = jnp.concatenate([bv, v.astype(bv.dtype)], axis=2)
            k_pos = jnp.concatenate([jnp.where(bvalid, bpos, -1), k_pos], axis=2)
        if plain:  # differentiable without a cache (training); a decode step
            W = cfg.sliding_window
            if n > QUERY_BLOCK and n % QUERY_BLOCK == 0:
                return attend_blocked(q, keys, vals, positions, k_pos, scale, QUERY_BLOCK, window=W, softcap=cap)[0]
            return attend(q, keys, vals, positions, k_pos, scale, window=W, softcap=cap)[0]
        return prefill_attention(q, keys, vals, positions, k_pos, scale, window=cfg.sliding_window, softcap=cap,
                                 own_keys=fresh)[0]

    def layer(carry, xs):
        h, ck, cv, cpos, cvalid, local = carry
        lp, l = xs["params"], xs["index"]
        hook = None if adapter is None else {**adapter, "lora": xs["lora"]}
        q_raw, k_raw, v = layer_qkv(cfg, lp, h, hook)
        s = xs.get("slots")
        q, k = apply_rope(q_raw, cos, sin), apply_rope(k_raw, cos, sin)
        k_stored = k_raw if relative else k
        if has_local:
            # Caches are written outside the `lax.cond` (the other kind's write is dropped), so that no
            # cache buffer passes through a branch; the branches only read them.
            local_layer = xs["is_local"]
            ck, cv, cpos, cvalid = global_write(k_stored, v, ck, cv, cpos, cvalid, l, s, enabled=~local_layer)
            q_loc, k_loc = apply_rope(q_raw, local_cos, local_sin), apply_rope(k_raw, local_cos, local_sin)

            def run_global():
                return global_attention(q, q_raw, k, v, ck, cv, cpos, cvalid, l, s, lp["o"])

            def run_local():  # no observations: zeros shaped as a global layer's (dropped after the scan)
                shapes = jax.eval_shape(run_global)[1]
                zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
                return local_attention(q_loc, k_loc, v, local, l), zeros

            out, obs = jax.lax.cond(local_layer, run_local, run_global)
            if local is not None and commit:
                local = rolling_write(local, l, k_loc, v, jnp.where(local_layer, positions, -1))
        else:
            ck, cv, cpos, cvalid = global_write(k_stored, v, ck, cv, cpos, cvalid, l, s)
            out, obs = global_attention(q, q_raw, k, v, ck, cv, cpos, cvalid, l, s, lp["o"])
        h = layer_finish(cfg, lp, h, out, hook)
        return (h, ck, cv, cpos, cvalid, local), obs

    xs = {"params": params["layers"], "index": jnp.asarray(cache_index)}
    if has_local:
        xs["is_local"] = jnp.asarray(is_local)
    if not fresh and commit:  # per scan step: the global layer's slots (those of local layers are unused)
        xs["slots"] = slots if not has_local else slots[jnp.asarray(np.where(is_local, 0, cache_index))]
    if adapter is not None:
        xs["lora"] = adapter["lora"]
    if remat:
        layer = jax.checkpoint(layer)
    local = None if cache is None or cache.local is None else (cache.local.k, cache.local.v, cache.local.pos,
                                                              cache.local.valid)
    init = (h, None, None, None, None, None) if cache is None else (h, cache.k, cache.v, cache.pos, cache.valid, local)
    (h, ck, cv, cpos, cvalid, local), obs = jax.lax.scan(layer, init, xs)
    if has_local:  # observations of the global layers only, as the cache holds
        obs = jax.tree.map(lambda a: a[np.asarray(cfg.global_layer_ids)], obs)
    if cache is not None and commit:
        local = None if local is None else KVCache(*local)
        cache = KVCache(k=ck, v=cv, pos=cpos, valid=cvalid, local=local)
    if logit_index is not None:
        h = jnp.take_along_axis(h, logit_index[..., None], axis=1)
    logits = output_logits(params, cfg, h)
    observations = Observations(
        window_queries=obs.get("window_queries"),
        window_positions=jnp.where(window_pos >= 0, window_pos, -1) if observe.window else None,
        column_mass=obs.get("column_mass"), step_probs=obs.get("step_probs"), query_mass=obs.get("query_mass"),
        lengths=n_real, attn_scale=scale,
        output_norms=obs.get("output_norms"), query_mean=obs.get("query_mean"), query_cov=obs.get("query_cov"),
        rope_inv_freq=tuple(float(x) for x in inv_freq) if observe.query_stats >= 0 else None)
    return logits, cache, observations
