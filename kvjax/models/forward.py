"""The forward pass: `extend` = embed -> layers -> logits, over any cache layout.

One function, `extend`, runs `n` new tokens through the model against a cache: a prefill is `extend`
on an empty cache (`fresh=True`), a question chunk or a decode step is `extend` on a filled one.
Each layer (`layer`) does qkv -> RoPE -> write its keys into the cache -> attention over what the
layout holds (`kvjax.kernels.attention` picks the implementation) -> record the observations the
spec asks for -> output projection and MLP. Layers are stacked `[L, ...]` and run under `lax.scan`
over a stacked cache (`KVCache`); a cache stored per layer (`RaggedCache`), or params split per layer
(`split_layers`), runs the same `layer` in a Python loop.

Gemma 2 / Gemma 3 (`cfg.gemma`): sliding-window layers attend over a rolling buffer of W slots
(kvjax.models.local) carried in `cache.local`; under the scan a `lax.cond` chooses the local or the
global attention of each layer, and only the global layers have observations and policy-visible slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.kernels.attention import Attention, Keys, attention
from kvjax.models.config import ModelConfig
from kvjax.models.llama import Params, embed_tokens, layer_finish, layer_qkv, output_logits
from kvjax.models.local import layer_plan, rolling_write
from kvjax.models.rope import apply_rope, inverse_frequencies, local_inverse_frequencies, rope_tables, slot_ranks
from kvjax.observations import CallView, LayerView, Observations, ObservationSpec


@struct.dataclass
class LayerCarry:
    """What flows from one layer to the next: h [B,n,E], the residual stream, the cache (None
    without one: training), and the riding rows' residual stream [B,m,E] (`RidingRows`; None without)."""

    h: jax.Array
    cache: Any
    riding: jax.Array | None = None


@struct.dataclass
class RidingRows:
    """Rows that ride a prefill (a producer's pass run inside it, e.g. LookaheadKV's tokens): in each
    layer, right after the prompt's rows have written their keys, these m rows attend to the layer's
    cache plus their own keys (causal by position) without being stored, reading the weights the
    prompt's rows just read. What they compute is what `extend(..., fresh=False, commit=False)` on the
    finished prefill's cache computes for them.

    embeds [B,m,E] their input vectors; positions [B,m] int32 (-1 = padding); adapter: a row-masked
    low-rank hook for them (`extend`'s `adapter`) or None; observe: what they record (static; no field
    in common with the prefill's own spec)."""

    embeds: jax.Array
    positions: jax.Array
    adapter: dict[str, Any] | None = None
    observe: ObservationSpec = struct.field(pytree_node=False, default=ObservationSpec())


@dataclasses.dataclass(frozen=True)
class Pass:
    """The static facts of one `extend` call."""

    cfg: ModelConfig
    spec: ObservationSpec
    fresh: bool
    commit: bool
    relative: bool
    has_cache: bool
    differentiable: bool


@struct.dataclass
class Shared:
    """The traced arrays every layer of one call reads: the call's view (positions, lengths) and the
    RoPE tables of its positions, global [B,n,D] and (models with sliding-window layers) local."""

    call: CallView
    cos: jax.Array
    sin: jax.Array
    local_cos: jax.Array | None = None
    local_sin: jax.Array | None = None


def split_layers(params: Params) -> Params:
    """params with "layers" as a tuple of per-layer pytrees: `extend` then runs its layers in a Python
    loop (slice once, outside a decode loop, for layouts stored per layer)."""
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a, l=l: a[l], params["layers"]) for l in range(n))}


def _own_keys(k: jax.Array, v: jax.Array, positions: jax.Array) -> Keys:
    """The call's own keys as a key set: k, v [B,Hkv,n,D] at positions [B,n] (every head)."""
    B, Hkv, n, _ = k.shape
    return Keys(k=k, v=v, pos=jnp.broadcast_to(positions[:, None, :], (B, Hkv, n)).astype(jnp.int32))


def _joined(stored: Keys, own: Keys) -> Keys:
    """Stored keys followed by the call's own (which are not written)."""
    return Keys(k=jnp.concatenate([stored.k, own.k.astype(stored.k.dtype)], axis=2),
                v=jnp.concatenate([stored.v, own.v.astype(stored.v.dtype)], axis=2),
                pos=jnp.concatenate([stored.pos, own.pos], axis=2))


def _relative(p: Pass, keys: Keys, q_raw: jax.Array, slots: jax.Array) -> tuple[Keys, jax.Array]:
    """StreamingLLM's cache-relative RoPE: every kept key rotated at its rank among its head's kept
    slots, each query at the rank of its own slot. Keys are stored un-rotated."""
    cfg = p.cfg
    inv_freq, dtype = inverse_frequencies(cfg), cfg.jnp_dtype
    ranks = slot_ranks(keys.pos >= 0, keys.pos)  # [B,Hkv,C]
    kcos, ksin = rope_tables(ranks, inv_freq, dtype)
    q_rank = jnp.repeat(jnp.take_along_axis(ranks, slots, axis=-1), cfg.num_heads // cfg.num_kv_heads, axis=1)
    qcos, qsin = rope_tables(q_rank, inv_freq, dtype)
    return keys.replace(k=apply_rope(keys.k, kcos, ksin)), apply_rope(q_raw, qcos, qsin)


def global_attention(p: Pass, s: Shared, cache: Any, l: Any, slots: Any, view: LayerView
                     ) -> tuple[Attention, dict[str, jax.Array]]:
    """A global layer's attention (its new keys already in `cache`, unless commit=False) and the
    observations recorded from it."""
    q, own = view.q, _own_keys(view.k, view.v, s.call.positions)
    if p.fresh:
        keys = own
    elif not p.commit:
        keys = _joined(cache.layer_keys(l), own)
    else:
        keys = cache.layer_keys(l)
        if p.relative:
            keys, q = _relative(p, keys, view.q_raw, slots)
    attn = attention(q, keys, s.call.positions, scale=p.cfg.attn_scale, softcap=p.cfg.attn_logit_softcapping,
                     returns=p.spec.needs(s.call), own_keys=p.fresh, differentiable=p.differentiable,
                     index_causal=not p.has_cache and not p.spec)
    return attn, p.spec.record(view, attn)


def local_attention(p: Pass, s: Shared, cache: Any, li: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """A sliding-window layer's output [B,Hq,n,D] over its rolling buffer `li` (not yet written: it holds
    earlier positions only) and the new keys; q, k rotated with the local RoPE."""
    keys = _own_keys(k, v, s.call.positions)
    if p.has_cache and not p.fresh:
        buf = cache.local
        keys = _joined(Keys(k=buf.k[li], v=buf.v[li], pos=jnp.where(buf.valid[li], buf.pos[li], -1)), keys)
    return attention(q, keys, s.call.positions, scale=p.cfg.attn_scale, window=p.cfg.sliding_window,
                     softcap=p.cfg.attn_logit_softcapping, own_keys=p.fresh, differentiable=p.differentiable).out


def _cond(pred: Any, if_true: Any, if_false: Any) -> Any:
    """`lax.cond`, or a plain branch when `pred` is a Python bool (the per-layer loop)."""
    if isinstance(pred, (bool, np.bool_)):
        return if_true() if pred else if_false()
    return jax.lax.cond(pred, if_true, if_false)


def mixed_attention(p: Pass, s: Shared, cache: Any, xs: dict[str, Any], view: LayerView
                    ) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """A layer of a model with sliding-window layers: global or local attention by `xs["is_local"]`.
    Caches are written outside the branches (the other kind's write dropped), so that no cache buffer
    passes through a `lax.cond`; the local branch records zeros shaped as the global one's."""
    l, is_local = xs["index"], xs["is_local"]
    static = isinstance(is_local, bool)
    if p.has_cache and p.commit and not (static and is_local):
        cache = cache.write_layer(l, view.k if not p.relative else xs["k_raw"], view.v, s.call.positions,
                                  xs.get("slots"), enabled=None if static else ~is_local)
    q_loc, k_loc = apply_rope(view.q_raw, s.local_cos, s.local_sin), apply_rope(xs["k_raw"], s.local_cos, s.local_sin)

    def run_global():
        attn, obs = global_attention(p, s, cache, l, xs.get("slots"), view)
        return attn.out, obs

    def run_local():  # under the scan: zeros shaped as a global layer's observations (dropped after it)
        zeros = None if static else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(run_global)[1])
        return local_attention(p, s, cache, l, q_loc, k_loc, view.v), zeros

    out, obs = _cond(is_local, run_local, run_global)
    if p.has_cache and p.commit and cache.local is not None and not (static and not is_local):
        cache = cache.replace(local=rolling_write(cache.local, l, k_loc, view.v,
                                                  s.call.positions if static else jnp.where(is_local, s.call.positions, -1)))
    return cache, out, obs


def layer(p: Pass, s: Shared, carry: LayerCarry, xs: dict[str, Any]) -> tuple[LayerCarry, dict[str, jax.Array]]:
    """One decoder layer: qkv -> RoPE -> cache write -> attention -> observations -> output and MLP."""
    lp, l, cache = xs["params"], xs["index"], carry.cache
    hook = None if "lora" not in xs else {**xs["adapter"], "lora": xs["lora"]}
    q_raw, k_raw, v = layer_qkv(p.cfg, lp, carry.h, hook)
    q, k = apply_rope(q_raw, s.cos, s.sin), apply_rope(k_raw, s.cos, s.sin)
    view = LayerView(q=q, q_raw=q_raw, k=k, v=v, wo=lp["o"], call=s.call)
    if p.cfg.local_layer_ids:
        cache, out, obs = mixed_attention(p, s, cache, {**xs, "k_raw": k_raw}, view)
    else:
        if p.has_cache and p.commit:
            cache = cache.write_layer(l, k_raw if p.relative else k, v, s.call.positions, xs.get("slots"))
        attn, obs = global_attention(p, s, cache, l, xs.get("slots"), view)
        out = attn.out
    return LayerCarry(h=layer_finish(p.cfg, lp, carry.h, out, hook), cache=cache), obs


def riding_layer(p: Pass, s: Shared, rp: Pass, rs: Shared, hook: dict[str, Any], carry: LayerCarry,
                 xs: dict[str, Any]) -> tuple[LayerCarry, dict[str, jax.Array] | None]:
    """One layer of a prefill with riding rows: the prompt's rows (`p`, `s`), then the riding rows (`rp`,
    `rs`: not fresh, not committed) against the cache the prompt's rows just wrote, with the layer's
    weights and `xs["riding_lora"]` (the rest of their adapter `hook` closed over)."""
    own = {k: v for k, v in xs.items() if k != "riding_lora"}
    out, obs = layer(p, s, LayerCarry(h=carry.h, cache=carry.cache), own)
    if hook is not None:
        own = {**own, "lora": xs["riding_lora"], "adapter": hook}
    rode, riding_obs = layer(rp, rs, LayerCarry(h=carry.riding, cache=out.cache), own)
    merged = None if obs is None and riding_obs is None else {**(obs or {}), **(riding_obs or {})}
    return out.replace(riding=rode.h), merged


def _layer_inputs(cfg: ModelConfig, params: Params, slots: Any, adapter: Any, per_layer: bool) -> Any:
    """What each layer reads besides the carry: a dict of arrays stacked over layers (for the scan),
    or a list of per-layer dicts with static indices (for the loop)."""
    is_local, index = layer_plan(cfg)
    if per_layer:
        layers = params["layers"] if isinstance(params["layers"], (tuple, list)) else split_layers(params)["layers"]
        xs = [{"params": lp, "index": int(index[i])} for i, lp in enumerate(layers)]
        for i, x in enumerate(xs):
            if cfg.local_layer_ids:
                x["is_local"] = bool(is_local[i])
            if slots is not None:
                x["slots"] = slots[0 if is_local[i] else int(index[i])]
            if adapter is not None:
                x["lora"], x["adapter"] = jax.tree.map(lambda a, i=i: a[i], adapter["lora"]), adapter
        return xs
    xs = {"params": params["layers"], "index": jnp.asarray(index)}
    if cfg.local_layer_ids:
        xs["is_local"] = jnp.asarray(is_local)
    if slots is not None:  # per scan step: the global layer's slots (those of local layers are unused)
        xs["slots"] = slots[jnp.asarray(np.where(is_local, 0, index))] if cfg.local_layer_ids else slots
    if adapter is not None:
        xs["lora"], xs["adapter"] = adapter["lora"], adapter
    return xs


def run_layers(step: Any, carry: LayerCarry, xs: Any) -> tuple[LayerCarry, dict[str, jax.Array]]:
    """The layers over the carry: `lax.scan` over stacked inputs, or a loop over per-layer ones
    (observations stacked over layers either way)."""
    if isinstance(xs, dict):
        if "adapter" in xs:  # the adapter's non-layer parts are closed over, not scanned
            adapter = xs.pop("adapter")
            return jax.lax.scan(lambda c, x: step(c, {**x, "adapter": adapter}), carry, xs)
        return jax.lax.scan(step, carry, xs)
    recorded = []
    for x in xs:
        carry, obs = step(carry, x)
        if obs is not None:  # a sliding-window layer records nothing
            recorded.append(obs)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *recorded) if recorded else {}


def check_call(cfg: ModelConfig, cache: Any, fresh: bool, commit: bool, rope_mode: str) -> None:
    """ValueError for arguments `extend` cannot honour, naming them and what is accepted."""
    if rope_mode not in ("original", "cache_relative"):
        raise ValueError(f"rope_mode={rope_mode!r}; accepted values: 'original', 'cache_relative'")
    if cache is None and not fresh:
        raise ValueError("extend: cache=None needs fresh=True")
    if not commit and (fresh or rope_mode != "original"):
        raise ValueError("extend: commit=False needs fresh=False and rope_mode='original'")
    if cache is not None:
        cache.check_model(cfg)


def _with_riding(p: Pass, shared: Shared, riding: RidingRows, cfg: ModelConfig, cache: Any, xs: Any,
                 adapter: Any) -> tuple[Any, Any, CallView]:
    """`extend`'s layer step and layer inputs for a prefill with riding rows, and the rows' `CallView`."""
    if not (p.fresh and p.commit and p.has_cache) or p.relative or adapter is not None:
        raise ValueError("extend: riding rows need a prefill (fresh=True, commit=True, a cache, rope_mode "
                         "'original') without an adapter of its own")
    shared_fields = {f for o in p.spec for f in o.fields} & {f for o in riding.observe for f in o.fields}
    if shared_fields:
        raise ValueError(f"extend: the riding rows' observations {sorted(shared_fields)} are also the prefill's")
    positions = riding.positions
    inv_freq = inverse_frequencies(cfg)
    call = CallView(positions=positions, lengths=jnp.sum(positions >= 0, axis=-1).astype(jnp.int32), fresh=False,
                    capacity=cache.capacity, attn_scale=cfg.attn_scale, rope_inv_freq=shared.call.rope_inv_freq)
    rs = Shared(call, *rope_tables(jnp.maximum(positions, 0), inv_freq, cfg.jnp_dtype))
    if cfg.local_layer_ids:
        rs = rs.replace(**dict(zip(("local_cos", "local_sin"), rope_tables(
            jnp.maximum(positions, 0), local_inverse_frequencies(cfg), cfg.jnp_dtype))))
    rp = dataclasses.replace(p, spec=riding.observe, fresh=False, commit=False)
    hook = None
    if riding.adapter is not None:
        hook = {k: v for k, v in riding.adapter.items() if k != "lora"}
        lora = riding.adapter["lora"]
        if isinstance(xs, dict):
            xs = {**xs, "riding_lora": lora}
        else:
            xs = [{**x, "riding_lora": jax.tree.map(lambda a, i=i: a[i], lora)} for i, x in enumerate(xs)]
    return functools.partial(riding_layer, p, shared, rp, rs, hook), xs, call


def extend(params: Params, cfg: ModelConfig, cache: Any, tokens: jax.Array | None, positions: jax.Array, *,
           fresh: bool, observe: ObservationSpec = ObservationSpec(), logit_index: jax.Array | None = None,
           slots: jax.Array | None = None, remat: bool = False, rope_mode: str = "original",
           inputs_embeds: jax.Array | None = None, adapter: dict[str, Any] | None = None, commit: bool = True,
           differentiable: bool = False, riding: RidingRows | None = None) -> tuple[jax.Array, Any, Observations]:
    """Runs `n` new tokens through the model, writing their keys/values into `cache`.

    tokens [B,n] int32; positions [B,n] int32 absolute positions (-1 = padding, never attended or kept).
    cache: a `KVCache` (`kvjax.models.local.init_cache` for an empty one), a `RaggedCache` (decode steps
      of n = 1), or None (fresh only, as in training: no cache is returned).
    fresh: the cache is empty and the tokens go to slots 0..n-1 (a prefill); attention then reads only
      the new keys. Otherwise they go to each head's first free slots and attend to the cache.
    observe: what to record (`ObservationSpec`); window queries are those of the last `observe.window`
      real tokens of each row (tokens are right-padded).
    logit_index [B,k]: indices of the tokens whose logits are returned (all tokens when None; k = 0: none, and
      the output head, the largest matrix of a small model, is not read).
    slots [L,B,Hkv,n]: where the new tokens are written (default: `cache.write_slots(n)`).
    remat: rematerialise each layer in the backward pass (training).
    rope_mode: "original", or "cache_relative" (StreamingLLM): keys are cached un-rotated; a filled cache
      is attended with every kept key rotated at its rank among the kept slots of its head, and each new
      query at the rank of its own slot. A prefill is the same either way.
    inputs_embeds [B,n,E]: input vectors used instead of `embed[tokens]` (tokens may then be None;
      Gemma's sqrt(hidden) scaling applies to token embeddings only, as in HF).
    adapter: a row-masked low-rank hook (LookaheadKV): {"lora": {proj: {"a": [L,in,r], "b": [L,r,out]}},
      "mask": [B,n] bool, "scale": float}; rows where mask is False compute exactly what they compute
      without it (bit-identical).
    commit: False (with fresh=False, rope_mode "original") attends the new tokens to the cache plus their
      own keys (causal by position) without writing them: the returned cache is `cache` itself.
    differentiable: every layer's attention is reverse-differentiable (a pass against a cache that is
      trained through, e.g. LookaheadKV's tokens); calls without a cache always are.
    riding: rows that ride a prefill (`RidingRows`; fresh, committed, with a cache, RoPE "original"): their
      observations are returned with the prefill's.
    Returns logits [B,n or k,V] float32, the updated cache, and the `Observations` asked for (their
    shapes: `kvjax.observations`; L counts the global layers, C the cache slots).
    Real tokens of a row must have distinct positions (contiguous, as the engine feeds them).
    """
    check_call(cfg, cache, fresh, commit, rope_mode)
    B, n = positions.shape
    if not fresh and slots is None and commit:
        slots = cache.write_slots(n)
    h = embed_tokens(params, cfg, tokens) if inputs_embeds is None else inputs_embeds.astype(cfg.jnp_dtype)
    inv_freq = inverse_frequencies(cfg)
    call = CallView(positions=positions, lengths=jnp.sum(positions >= 0, axis=-1).astype(jnp.int32), fresh=fresh,
                    capacity=n if cache is None else cache.capacity, attn_scale=cfg.attn_scale,
                    rope_inv_freq=tuple(float(x) for x in inv_freq))
    shared = Shared(call, *rope_tables(jnp.maximum(positions, 0), inv_freq, cfg.jnp_dtype))
    if cfg.local_layer_ids:
        shared = shared.replace(**dict(zip(("local_cos", "local_sin"), rope_tables(
            jnp.maximum(positions, 0), local_inverse_frequencies(cfg), cfg.jnp_dtype))))
    p = Pass(cfg, observe, fresh, commit, rope_mode == "cache_relative", cache is not None,
             differentiable or cache is None)
    step = functools.partial(layer, p, shared)
    per_layer = (cache is not None and not cache.stacked) or isinstance(params["layers"], (tuple, list))
    xs = _layer_inputs(cfg, params, None if fresh or not commit else slots, adapter, per_layer)
    carry = LayerCarry(h=h, cache=cache)
    riding_calls = ()
    if riding is not None:
        step, xs, riding_call = _with_riding(p, shared, riding, cfg, cache, xs, adapter)
        carry, riding_calls = carry.replace(riding=riding.embeds.astype(cfg.jnp_dtype)), (riding_call,)
    carry, obs = run_layers(jax.checkpoint(step) if remat else step, carry, xs)
    if cfg.local_layer_ids and not per_layer:  # observations of the global layers only, as the cache holds
        obs = jax.tree.map(lambda a: a[np.asarray(cfg.global_layer_ids)], obs)
    h = carry.h if logit_index is None else jnp.take_along_axis(carry.h, logit_index[..., None], axis=1)
    per_call = observe.per_call(call)
    for c in riding_calls:
        per_call.update(riding.observe.per_call(c))
    recorded = Observations(**obs, **per_call, lengths=call.lengths, attn_scale=cfg.attn_scale)
    return output_logits(params, cfg, h), carry.cache if commit else cache, recorded
