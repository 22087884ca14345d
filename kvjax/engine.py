"""The generation engine: bucketed batched prefill -> (compress) -> `lax.while_loop` decode.

Prompts are right-padded to a length bucket; row b's prompt sits in cache slots 0..len_b-1 at
positions 0..len_b-1, and padding is masked by position -1. Each (bucket, batch size, policy,
budget, max_new_tokens bucket) compiles one prefill and one decode loop, reused by later calls.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, gather_slots
from kvjax.models.config import ModelConfig
from kvjax.models.llama import Observe, extend
from kvjax.models.model import Model
from kvjax.sampling import Sampler

BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MIN_QUESTION_BUCKET = 64
# max_new_tokens is rounded up to one of these for the compiled shapes (the loop stops at the real limit)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Compilations so far, per jitted function (traced once per distinct static configuration).
TRACE_COUNTS: collections.Counter = collections.Counter()


@dataclasses.dataclass
class GenerateOutput:
    """tokens [B, max_new_tokens] int32 (padded with `pad_id` after a stop token);
    lengths [B]: generated tokens per row, the stop token included; texts: decoded answers
    (None without a tokenizer); prompt_lengths [B]; cache_bytes: allocated bytes of the decode cache;
    kept [B]: KV entries kept per (layer, head) after prefill compression, averaged over layers and heads;
    kept_final [B]: the same at the end of decoding (decode-time policies evict as they go)."""

    tokens: np.ndarray
    lengths: np.ndarray
    texts: list[str] | None
    prompt_lengths: np.ndarray
    cache_bytes: int
    kept: np.ndarray
    kept_final: np.ndarray
    pad_id: int = 0


def bucket_length(n: int, buckets: Sequence[int] = BUCKETS) -> int:
    """The smallest bucket >= n (multiples of the largest bucket beyond it)."""
    for b in buckets:
        if b >= n:
            return b
    top = buckets[-1]
    return -(-n // top) * top


def encode_prompts(model: Model, prompts: Any, *, chat_template: bool = False, what: str = "prompts") -> list[list[int]]:
    """Strings (tokenized, optionally chat-templated) or token-id sequences -> lists of ids."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) and not isinstance(prompts, np.ndarray) or len(prompts) == 0:
        raise ValueError(f"{what} must be a non-empty list of strings or of token-id sequences")
    vocab = model.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise ValueError(f"{what}[{i}] is a string, but the model at {model.path} has no tokenizer: pass token ids")
            if chat_template:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tok(p)["input_ids"]
        else:
            if chat_template:
                raise ValueError("chat_template=True needs string prompts, not token ids")
            arr = np.asarray(p)
            if arr.size == 0:
                raise ValueError(f"{what}[{i}] is empty")
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"{what}[{i}] must be a string or a 1-D sequence of int token ids, got {arr.dtype} {arr.shape}")
            ids = arr.tolist()
        if len(ids) == 0:
            raise ValueError(f"{what}[{i}] is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what}[{i}] has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        out.append(list(ids))
    return out


def _pad(rows: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads to `length`: tokens [B, length] and positions [B, length] (-1 on padding)."""
    tokens = np.full((len(rows), length), pad_id, np.int32)
    positions = np.full((len(rows), length), -1, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
        positions[b, : len(r)] = np.arange(len(r))
    return tokens, positions


def _constrain(cache: KVCache, mesh) -> KVCache:
    if mesh is None:
        return cache
    from kvjax.sharding import cache_shardings

    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def observe_for(policy) -> Observe:
    """What the model prefill must record for `policy` (nothing without one)."""
    if policy is None:
        return Observe()
    req = policy.requirements()
    return Observe(window=req.window, column_mass=req.column_mass)


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "observe", "rope_mode", "sampler", "mesh"))
def _prefill(params, tokens, positions, lengths, key, *, cfg: ModelConfig, capacity: int, observe: Observe,
             rope_mode: str, sampler: Sampler, mesh):
    """The model prefill, shared by every policy: first-token ids [B], the full cache of `capacity`
    slots, the `Observations` asked for, and the first-token logits [B,V]."""
    from kvjax.observations import Observations

    TRACE_COUNTS["prefill"] += 1
    B, T = tokens.shape
    window_index = window_pos = None
    if observe.window:
        window_pos = lengths[:, None] - observe.window + jnp.arange(observe.window)
        window_index = jnp.maximum(window_pos, 0)
    cache = _constrain(KVCache.init(cfg.num_layers, B, cfg.num_kv_heads, capacity, cfg.head_dim, cfg.jnp_dtype), mesh)
    logits, cache, obs = extend(params, cfg, cache, tokens, positions, fresh=True, observe=observe,
                                window_index=window_index, logit_index=(lengths - 1)[:, None], rope_mode=rope_mode)
    observations = Observations(
        window_queries=obs.get("window_queries"),
        window_positions=None if window_pos is None else jnp.where(window_pos >= 0, window_pos, -1),
        column_mass=obs.get("column_mass"),
        lengths=lengths,
    )
    return sampler(logits[:, 0], key), cache, observations, logits[:, 0]


@functools.partial(jax.jit, static_argnames=("policy", "capacity", "mesh"))
def _compress(cache, observations, plan, *, policy, capacity: int, mesh):
    """The policy's prefill eviction on a full cache: the compacted (or masked) cache and the
    policy's decode state. Observations recorded for a wider window are cut to the policy's."""
    TRACE_COUNTS["compress"] += 1
    w = policy.requirements().window
    if observations.window_queries is not None and observations.window_queries.shape[3] != w:
        observations = observations.replace(
            window_queries=observations.window_queries[:, :, :, -w:] if w else None,
            window_positions=observations.window_positions[:, -w:] if w else None)
    keep, slot_state = policy.prefill_keep(plan, cache, observations)
    if plan.compact:
        cache, src = cache.compact(keep, plan.capacity)
        if slot_state is not None:
            slot_state = jax.tree.map(lambda x: gather_slots(x, src), slot_state)
    else:
        cache = cache.evict(keep)
        if cache.capacity < capacity:
            cache, _ = cache.compact(cache.valid, capacity)
    cache = _constrain(cache, mesh)
    return cache, policy.init_decode(plan, cache, slot_state)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "rope_mode"))
def _feed(params, cache, tokens, positions, logit_index, *, cfg: ModelConfig, mesh, rope_mode: str = "original"):
    """Appends a chunk (a question, a continuation) to a filled cache; logits [B,k,V] at `logit_index` [B,k]."""
    TRACE_COUNTS["feed"] += 1
    logits, cache, _ = extend(params, cfg, cache, tokens, positions, fresh=False, logit_index=logit_index,
                              rope_mode=rope_mode)
    return logits, _constrain(cache, mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "policy", "sampler", "stop_ids", "pad_id", "mesh",
                                             "rope_mode"),
                   donate_argnames=("cache",))
def _decode(params, cache, state, first, pos0, key, plan, limit, *, cfg: ModelConfig, steps: int, policy,
            sampler: Sampler, stop_ids: tuple[int, ...], pad_id: int, mesh, rope_mode: str):
    """Decodes up to `limit - 1` (traced, <= steps) tokens after `first` [B] under `lax.while_loop`;
    returns tokens [B, steps] (pad after `limit`). `policy` (with its `plan` and `state`) is given
    only for decode-time eviction; every other policy shares the plain loop of its cache capacity."""
    TRACE_COUNTS["decode"] += 1
    B = first.shape[0]
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    decode_time = policy is not None
    out = jnp.full((B, steps), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stops)

    def cond(c):
        i, _, _, _, _, _, done, _ = c
        return (i < limit) & ~jnp.all(done)

    def body(c):
        i, out, cache, state, last, pos, done, key = c
        slots = cache.write_slots(1)
        q_pos = jnp.where(done, -1, pos)[:, None]
        logits, cache, obs = extend(params, cfg, cache, last[:, None], q_pos, fresh=False,
                                    observe=Observe(step_probs=decode_time), slots=slots, rope_mode=rope_mode)
        key, sub = jax.random.split(key)
        nxt = jnp.where(done, pad_id, sampler(logits[:, 0], sub))
        out = out.at[:, i].set(nxt)
        if decode_time:
            state, keep = policy.decode_update(plan, state, cache, obs["step_probs"], slots[..., 0], i)
            cache = cache.evict(keep)
        cache = _constrain(cache, mesh)
        return i + 1, out, cache, state, nxt, pos + 1, done | jnp.isin(nxt, stops), key

    init = (jnp.int32(1), out, cache, state, first, pos0, done, key)
    _, out, cache, state, _, _, _, _ = jax.lax.while_loop(cond, body, init)
    return out, cache


def _rope_mode(policy) -> str:
    return "original" if policy is None else policy.requirements().rope_mode


def _resolve_policy(policy):
    if policy is None:
        return None
    from kvjax.policies import resolve

    return resolve(policy)


def make_plan(policy, lengths: np.ndarray, cfg: ModelConfig, *, budget, compression_ratio, bucket: int,
              room: int, question_tokens: int):
    """The policy's host-side plan, its capacity lifted to what any batch of this bucket needs.

    The plan goes to jit as a traced pytree (per-row counts are data), and its static capacity is
    that of a row filling the bucket, so every batch of a bucket shares one compilation.
    """
    kw = dict(budget=budget, compression_ratio=compression_ratio, max_new_tokens=room, bucket=bucket,
              question_tokens=question_tokens)
    plan = policy.plan(tuple(int(x) for x in lengths), cfg.num_layers, cfg.num_kv_heads, **kw)
    try:
        widest = policy.plan((bucket,), cfg.num_layers, cfg.num_kv_heads, **kw)
    except ValueError:  # e.g. a per-row rule the padded length cannot satisfy: keep the exact plan
        return plan
    return plan.replace(capacity=max(plan.capacity, widest.capacity), compact=plan.compact or widest.compact)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run a batch: the full cache (policy None) or a policy at a budget or ratio."""

    policy: Any = None
    budget: int | None = None
    compression_ratio: float | None = None


@dataclasses.dataclass
class _Batch:
    """A validated, encoded batch (host side) and its bucketed shapes."""

    rows: list[list[int]]
    q_rows: list[list[int]] | None
    lengths: np.ndarray  # [B]
    q_lengths: np.ndarray  # [B]
    bucket: int
    q_bucket: int
    steps: int
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    sampler: Sampler

    @property
    def room(self) -> int:
        return self.q_bucket + self.steps


def _prepare(model: Model, prompts: Any, questions: Any, max_new_tokens: int, temperature: float, top_k, top_p,
             stop_tokens, chat_template: bool, buckets: Sequence[int], question_tokens: int = 0) -> _Batch:
    cfg = model.config
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    rows = encode_prompts(model, prompts, chat_template=chat_template)
    q_rows = None
    if questions is not None:
        q_rows = encode_prompts(model, questions, what="questions")
        if len(q_rows) != len(rows):
            raise ValueError(f"got {len(rows)} prompts but {len(q_rows)} questions: give one question per context")
    B = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    q_lengths = np.array([len(r) for r in q_rows], np.int32) if q_rows else np.zeros(B, np.int32)
    total = int((lengths + q_lengths).max()) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({int((lengths + q_lengths).max())} tokens) plus max_new_tokens={max_new_tokens} "
            f"needs {total} positions, more than the model allows (max_position_embeddings={cfg.max_position_embeddings})"
        )
    if cfg.sliding_window is not None and total > cfg.sliding_window:
        raise ValueError(f"sequences of {total} tokens exceed the sliding_window={cfg.sliding_window} of this "
                         "checkpoint, which kvjax does not implement")
    if stop_tokens is None:
        stop = set(cfg.eos_token_ids)
        if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
            stop.add(int(model.tokenizer.eos_token_id))
        stop_ids = tuple(sorted(stop))
    else:
        stop_ids = tuple(sorted({int(t) for t in stop_tokens}))
    # questions are short and vary by task: one floor bucket lets tasks share compiled programs
    q_bucket = bucket_length(max(int(q_lengths.max()), int(question_tokens)), [b for b in buckets if b >= MIN_QUESTION_BUCKET] or buckets) if q_rows else 0
    return _Batch(rows=rows, q_rows=q_rows, lengths=lengths, q_lengths=q_lengths,
                  bucket=bucket_length(int(lengths.max()), buckets), q_bucket=q_bucket,
                  steps=bucket_length(int(max_new_tokens), STEP_BUCKETS), max_new_tokens=int(max_new_tokens),
                  stop_ids=stop_ids, pad_id=cfg.pad_token_id if cfg.pad_token_id is not None else 0,
                  sampler=Sampler(float(temperature), top_k, top_p))


def _plan_for(model: Model, batch: _Batch, policy, budget, compression_ratio):
    if policy is None:
        if budget is not None or compression_ratio is not None:
            raise ValueError("budget / compression_ratio need a policy (policy=None keeps the full cache)")
        return None
    return make_plan(policy, batch.lengths, model.config, budget=budget, compression_ratio=compression_ratio,
                     bucket=batch.bucket, room=batch.room, question_tokens=batch.q_bucket)


def _answer(model: Model, batch: _Batch, first, cache, state, policy, plan, key) -> GenerateOutput:
    """Feeds the questions (if any) to a prefilled, compressed cache, then decodes."""
    cfg = model.config
    k_question, k_decode = jax.random.split(key)
    kept = _mean_kept(cache)  # on device; fetched at the end so dispatch does not wait for prefill
    pos0 = jnp.asarray(batch.lengths)
    if batch.q_rows:
        q_tokens, q_pos = _pad(batch.q_rows, batch.q_bucket, batch.pad_id)
        q_pos = np.where(q_pos >= 0, q_pos + batch.lengths[:, None], -1).astype(np.int32)
        logits, cache = _feed(model.params, cache,
                              *_batch_put(model.mesh, q_tokens, q_pos, (batch.q_lengths - 1)[:, None]),
                              cfg=cfg, mesh=model.mesh, rope_mode=_rope_mode(policy))
        first = batch.sampler(logits[:, 0], k_question)
        pos0 = jnp.asarray(batch.lengths + batch.q_lengths)
    cache_bytes = cache.nbytes()
    decode_time = policy is not None and policy.requirements().step_probs
    out, cache = _decode(model.params, cache, state if decode_time else None, first, pos0, k_decode,
                         plan if decode_time else None, jnp.int32(batch.max_new_tokens), cfg=cfg, steps=batch.steps,
                         policy=policy if decode_time else None, sampler=batch.sampler, stop_ids=batch.stop_ids,
                         pad_id=batch.pad_id, mesh=model.mesh, rope_mode=_rope_mode(policy))
    out = np.array(jax.device_get(out))[:, :batch.max_new_tokens]
    B = len(batch.rows)
    out_lengths = np.full(B, batch.max_new_tokens, np.int32)
    texts = [] if model.tokenizer is not None else None
    for b in range(B):
        hit = np.flatnonzero(np.isin(out[b], batch.stop_ids)) if batch.stop_ids else []
        if len(hit):
            out_lengths[b] = hit[0] + 1
            out[b, hit[0] + 1:] = batch.pad_id
        if texts is not None:
            texts.append(model.tokenizer.decode(out[b, : out_lengths[b]].tolist(), skip_special_tokens=True))
    return GenerateOutput(tokens=out, lengths=out_lengths, texts=texts, prompt_lengths=batch.lengths,
                          cache_bytes=cache_bytes, kept=np.asarray(kept), kept_final=np.asarray(_mean_kept(cache)),
                          pad_id=batch.pad_id)


def generate(
    model: Model,
    prompts: Any,
    *,
    questions: Any = None,
    policy: Any = None,
    budget: int | None = None,
    compression_ratio: float | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    chat_template: bool = False,
    buckets: Sequence[int] = BUCKETS,
    question_tokens: int = 0,
) -> GenerateOutput:
    """Generates continuations for a batch of prompts of different lengths.

    prompts: strings (needs a tokenizer) or token-id sequences. With `questions`, the prompts are
      contexts: each context is prefilled (and compressed by `policy`), then its question is fed
      against that cache and answered from it (kvpress's question-agnostic protocol).
    policy: None (full cache), a registered name (`kvjax.policies.available()`), or a policy object;
      with a policy give exactly one of `budget` (entries kept per KV head) or `compression_ratio`.
    temperature 0 is greedy; otherwise sampling with optional top_k / top_p and a PRNG `key`.
    stop_tokens: ids that end a row (default: the model's EOS ids).
    question_tokens: pad the questions to at least this many tokens, so that calls whose questions
      differ in length share one compiled program (padding is masked; answers are unchanged).
    """
    policy = _resolve_policy(policy)
    if policy is None and (budget is not None or compression_ratio is not None):
        raise ValueError("budget / compression_ratio need a policy (policy=None keeps the full cache)")
    batch = _prepare(model, prompts, questions, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                     chat_template, buckets, question_tokens)
    plan = _plan_for(model, batch, policy, budget, compression_ratio)
    key = jax.random.PRNGKey(0) if key is None else key
    k_prefill, k_rest = jax.random.split(key)
    data = _batch_put(model.mesh, *_pad(batch.rows, batch.bucket, batch.pad_id), batch.lengths)
    first, cache, state = _prefill_and_compress(model, data, k_prefill, policy, plan, batch.bucket,
                                                batch.bucket + batch.room, batch.sampler)
    return _answer(model, batch, first, cache, state, policy, plan, k_rest)


def compress(
    model: Model,
    prompts: Any,
    *,
    policy: Any,
    budget: int | None = None,
    compression_ratio: float | None = None,
    chat_template: bool = False,
    buckets: Sequence[int] = BUCKETS,
) -> KVCache:
    """Prefills `prompts` and compresses the cache with `policy`, without decoding: which entries
    each layer and KV head kept. Arguments as in `generate`.

    Returns the cache: k, v [L, B, Hkv, C, D]; pos [L, B, Hkv, C] (the prompt position of each slot)
    and valid [L, B, Hkv, C] (kept), over the C slots the policy compacts into.
    """
    policy = _resolve_policy(policy)
    if policy is None:
        raise ValueError("compress needs a policy (a registered name or a policy object), got None")
    batch = _prepare(model, prompts, None, 1, 0.0, None, None, None, chat_template, buckets)
    plan = _plan_for(model, batch, policy, budget, compression_ratio)
    data = _batch_put(model.mesh, *_pad(batch.rows, batch.bucket, batch.pad_id), batch.lengths)
    _, cache, _ = _prefill_and_compress(model, data, jax.random.PRNGKey(0), policy, plan, batch.bucket,
                                        batch.bucket, batch.sampler)
    return cache


def generate_settings(
    model: Model,
    prompts: Any,
    settings: Sequence[Setting],
    *,
    questions: Any = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    chat_template: bool = False,
    buckets: Sequence[int] = BUCKETS,
    question_tokens: int = 0,
    on_error: str = "raise",
) -> list[GenerateOutput | ValueError]:
    """`generate` for one batch under several settings, sharing the model prefill between them.

    The prefill runs once per RoPE mode among the settings, recording the union of what their
    policies observe (the widest window, column mass if any needs it); each setting then
    compresses its own copy of that cache. Returns one output per setting, each equal to
    `generate(model, prompts, questions=questions, **vars(setting), ...)` with the same `key`.
    on_error: "raise" (default), or "return": a setting that is invalid for these prompts (its
    policy rejects the budget) gets its ValueError in its slot and the others still run.
    """
    if on_error not in ("raise", "return"):
        raise ValueError(f"on_error must be 'raise' or 'return', got {on_error!r}")
    policies = [_resolve_policy(st.policy) for st in settings]
    batch = _prepare(model, prompts, questions, max_new_tokens, temperature, top_k, top_p, stop_tokens,
                     chat_template, buckets, question_tokens)
    plans, errors = [], {}
    for j, (p, st) in enumerate(zip(policies, settings)):
        try:
            plans.append(_plan_for(model, batch, p, st.budget, st.compression_ratio))
        except ValueError as err:  # e.g. a budget below what the policy protects, for these prompts
            if on_error == "raise":
                raise
            plans.append(None)
            errors[j] = err
    key = jax.random.PRNGKey(0) if key is None else key
    k_prefill, k_rest = jax.random.split(key)
    data = _batch_put(model.mesh, *_pad(batch.rows, batch.bucket, batch.pad_id), batch.lengths)
    capacity = batch.bucket + batch.room
    prefilled = {}
    outputs = []
    for j, (policy, plan) in enumerate(zip(policies, plans)):
        if j in errors:
            outputs.append(errors[j])
            continue
        mode = _rope_mode(policy)
        if mode not in prefilled:
            group = [p for j, p in enumerate(policies) if _rope_mode(p) == mode and p is not None and j not in errors]
            observe = Observe(window=max([p.requirements().window for p in group], default=0),
                              column_mass=any(p.requirements().column_mass for p in group))
            first, cache, observations, _ = _prefill(model.params, *data, k_prefill, cfg=model.config,
                                                     capacity=batch.bucket, observe=observe, rope_mode=mode,
                                                     sampler=batch.sampler, mesh=model.mesh)
            prefilled[mode] = first, cache, observations
        first, cache, observations = prefilled[mode]
        if policy is None:
            cache, state = _grow(cache, capacity=capacity, mesh=model.mesh), None
        else:
            cache, state = _compress(cache, observations, plan, policy=policy, capacity=capacity, mesh=model.mesh)
        outputs.append(_answer(model, batch, first, cache, state, policy, plan, k_rest))
    return outputs


@functools.partial(jax.jit, static_argnames=("capacity", "mesh"))
def _grow(cache: KVCache, *, capacity: int, mesh) -> KVCache:
    """The same cache with empty slots appended up to `capacity` (slot layout unchanged)."""
    return _constrain(cache.grow(capacity), mesh)


def _mean_kept(cache: KVCache) -> jax.Array:
    """Valid entries per (layer, head), averaged over layers and heads: [B] float32."""
    return cache.num_valid().astype(jnp.float32).mean(axis=(0, 2))


def _prefill_and_compress(model: Model, data, key, policy, plan, bucket: int, capacity: int, sampler: Sampler):
    """Prefill (a full cache of `bucket` slots when a policy compresses it, else `capacity`), then
    the policy's compression. Returns first-token ids, the cache and the policy's decode state."""
    first, cache, observations, _ = _prefill(
        model.params, *data, key, cfg=model.config, capacity=bucket if policy is not None else capacity,
        observe=observe_for(policy), rope_mode=_rope_mode(policy), sampler=sampler, mesh=model.mesh)
    if policy is None:
        return first, cache, None
    cache, state = _compress(cache, observations, plan, policy=policy, capacity=capacity, mesh=model.mesh)
    return first, cache, state


def _batch_put(mesh, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Host arrays -> device arrays, the batch axis sharded over `data` when a mesh is given."""
    if mesh is None:
        return tuple(jnp.asarray(a) for a in arrays)
    from kvjax.sharding import logical_sharding

    return tuple(jax.device_put(a, logical_sharding(("batch",) + (None,) * (a.ndim - 1), a.shape, mesh)) for a in arrays)


def continuation_logits(
    model: Model,
    contexts: Any,
    continuations: Any,
    *,
    policy: Any = None,
    budget: int | None = None,
    compression_ratio: float | None = None,
    buckets: Sequence[int] = BUCKETS,
) -> list[np.ndarray]:
    """Teacher-forces each continuation after its (compressed) context.

    Returns, per row, float32 logits [len(continuation), V]: row j is the distribution after
    continuation token j (predicting token j+1), read from the cache the policy left. Compare two
    policies' outputs (e.g. against policy=None) for fidelity: next-token KL and top-1 agreement.
    """
    cfg = model.config
    policy = _resolve_policy(policy)
    if policy is None and (budget is not None or compression_ratio is not None):
        raise ValueError("budget / compression_ratio need a policy (policy=None keeps the full cache)")
    rows = encode_prompts(model, contexts, what="contexts")
    conts = encode_prompts(model, continuations, what="continuations")
    if len(conts) != len(rows):
        raise ValueError(f"got {len(rows)} contexts but {len(conts)} continuations: give one per context")
    lengths = np.array([len(r) for r in rows], np.int32)
    c_lengths = np.array([len(r) for r in conts], np.int32)
    total = int((lengths + c_lengths).max())
    if total > cfg.max_position_embeddings:
        raise ValueError(f"context + continuation of {total} tokens is more than the model allows "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    T = bucket_length(int(lengths.max()), buckets)
    n = bucket_length(int(c_lengths.max()), buckets)
    plan = None
    if policy is not None:
        plan = make_plan(policy, lengths, cfg, budget=budget, compression_ratio=compression_ratio, bucket=T,
                         room=n, question_tokens=n)
    tokens, positions = _pad(rows, T, pad_id)
    data = _batch_put(model.mesh, tokens, positions, lengths)
    _, cache, _ = _prefill_and_compress(model, data, jax.random.PRNGKey(0), policy, plan, T, T + n, Sampler())
    c_tokens, c_pos = _pad(conts, n, pad_id)
    c_pos = np.where(c_pos >= 0, c_pos + lengths[:, None], -1).astype(np.int32)
    index = np.broadcast_to(np.arange(n, dtype=np.int32), (len(rows), n))
    logits, _ = _feed(model.params, cache, *_batch_put(model.mesh, c_tokens, c_pos, index), cfg=cfg, mesh=model.mesh,
                      rope_mode=_rope_mode(policy))
    logits = np.asarray(jax.device_get(logits))
    return [logits[b, : c_lengths[b]] for b in range(len(rows))]
