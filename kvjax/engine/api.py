"""The public entry points: `generate`, `generate_settings`, `compress`, `continuation_logits`.

One request runs: host-side encoding and bucketing (`inputs`), one jitted model prefill shared by
every setting that needs the same RoPE mode, each setting's jitted compression, then the question
feed and the jitted decode loop (`steps`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.engine import steps
from kvjax.engine.inputs import (
    BUCKETS,
    Batch,
    bucket_length,
    check_positions,
    encode_prompts,
    pad_id,
    pad_rows,
    prepare,
    put_batch,
)
from kvjax.lookahead import check_positions as check_lookahead_positions
from kvjax.models.config import ModelConfig
from kvjax.models.model import Model
from kvjax.policies import Plan, Policy, resolve
from kvjax.policies.base import check_budget, row_budgets
from kvjax.policies.registry import canonical_name, name_of
from kvjax.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run a batch: the full cache (policy None), or `policy` (a preset name or a policy
    object) at exactly one of `compression_ratio` (the fraction removed, in [0, 1)) or `budget`
    (entries kept per KV head)."""

    policy: str | Policy | None = None
    compression_ratio: float | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.policy is None:
            if self.compression_ratio is not None or self.budget is not None:
                raise ValueError("the full-cache setting (policy=None) takes no compression_ratio or budget: "
                                 "budget / compression_ratio need a policy (policy=None keeps the full cache)")
            return
        check_budget(self.budget, self.compression_ratio, self.policy_name)

    @functools.cached_property
    def policy_name(self) -> str:
        """"full", the canonical preset name of a registered name in any accepted spelling (an
        unregistered string as given: it is refused when run), or `registry.name_of(policy)`."""
        if self.policy is None:
            return "full"
        if isinstance(self.policy, str):
            try:
                return canonical_name(self.policy)
            except ValueError:
                return self.policy
        return name_of(self.policy)

    @property
    def label(self) -> str:
        """``full``, ``r=0.5`` or ``C=128``."""
        if self.policy is None:
            return "full"
        return f"r={self.compression_ratio:g}" if self.compression_ratio is not None else f"C={self.budget}"

    def kwargs(self) -> dict[str, Any]:
        return {"policy": self.policy, "compression_ratio": self.compression_ratio, "budget": self.budget}


@dataclasses.dataclass
class GenerateOutput:
    """tokens [B, max_new_tokens] int32 (padded with `pad_id` after a stop token);
    lengths [B]: generated tokens per row, the stop token included; texts: decoded answers
    (None without a tokenizer); prompt_lengths [B]; cache_bytes: allocated bytes of the decode cache;
    kept [B]: KV entries kept per (layer, head) after prefill compression, averaged over layers and heads
      (layers: those a policy acts on, i.e. Gemma's global layers; its sliding-window buffers are not counted);
    kept_final [B]: the same at the end of decoding (decode-time policies evict as they go);
    kept_peak / kept_mean [B]: the most and the mean entries per (layer, head) the cache held while
      the row decoded (after the question, and after each generated token's step);
    kv_bytes_peak / kv_bytes_mean [B]: the key/value bytes of those entries, over all layers and heads;
    budget [B]: the setting's nominal entries per KV head for each row (kvpress's int(T*(1-r)) for a
      ratio), None for the full cache; budget_reached [B]: whether the cache held at most that many
      entries (+1 for the decode write) at some point, i.e. whether the policy really compressed."""

    tokens: np.ndarray
    lengths: np.ndarray
    texts: list[str] | None
    prompt_lengths: np.ndarray
    cache_bytes: int
    kept: np.ndarray
    kept_final: np.ndarray
    pad_id: int = 0
    kept_peak: np.ndarray | None = None
    kept_mean: np.ndarray | None = None
    kv_bytes_peak: np.ndarray | None = None
    kv_bytes_mean: np.ndarray | None = None
    budget: np.ndarray | None = None
    budget_reached: np.ndarray | None = None


def make_plan(policy: Policy, lengths: np.ndarray, cfg: ModelConfig, *, budget: int | None,
              compression_ratio: float | None, bucket: int, room: int, question_tokens: int) -> Plan:
    """The policy's host-side plan, its capacity lifted to what any batch of this bucket needs.

    The plan goes to jit as a traced pytree (per-row counts are data), and its static capacity is
    that of a row filling the bucket, so every batch of a bucket shares one compilation.
    """
    kw = dict(budget=budget, compression_ratio=compression_ratio, max_new_tokens=room, bucket=bucket,
              question_tokens=question_tokens)
    # policies act on the global layers only (all layers, but for the sliding-window layers of Gemma)
    plan = policy.plan(tuple(int(x) for x in lengths), cfg.num_global_layers, cfg.num_kv_heads, **kw)
    try:
        widest = policy.plan((bucket,), cfg.num_global_layers, cfg.num_kv_heads, **kw)
    except ValueError:  # e.g. a per-row rule the padded length cannot satisfy: keep the exact plan
        return plan
    return plan.replace(capacity=max(plan.capacity, widest.capacity), compact=plan.compact or widest.compact)


@dataclasses.dataclass
class _Run:
    """One setting of a request: its resolved policy and plan (None for the full cache)."""

    setting: Setting
    policy: Policy | None
    plan: Plan | None


def _plan_runs(model: Model, settings: Sequence[Setting], lengths: np.ndarray, *, bucket: int, room: int,
               question_tokens: int, on_error: str) -> list[_Run | ValueError]:
    """Resolves and plans every setting. A setting its policy rejects for these prompts (a budget
    below what it protects, a row too short) raises, or with on_error="return" takes the error's place."""
    if on_error not in ("raise", "return"):
        raise ValueError(f"on_error must be 'raise' or 'return', got {on_error!r}")
    runs: list[_Run | ValueError] = []
    for st in settings:
        st = st if isinstance(st, Setting) else Setting(*st)
        policy = None if st.policy is None else resolve(st.policy)
        if policy is None:
            runs.append(_Run(st, None, None))
            continue
        try:
            plan = make_plan(policy, lengths, model.config, budget=st.budget, compression_ratio=st.compression_ratio,
                             bucket=bucket, room=room, question_tokens=question_tokens)
        except ValueError as err:
            err = _plan_error(policy, st, lengths, model.config, err, bucket=bucket, room=room,
                              question_tokens=question_tokens)
            if on_error == "raise":
                raise err from None
            runs.append(err)
            continue
        runs.append(_Run(st, policy, plan))
    return runs


def _plan_error(policy: Policy, st: Setting, lengths: np.ndarray, cfg: ModelConfig, err: ValueError, **kw: int
                ) -> ValueError:
    """The policy's refusal of a batch, naming the policy, the ratio or budget, and the first row
    that it refuses on its own (its index and length)."""
    what = f"budget={st.budget}" if st.budget is not None else f"compression_ratio={st.compression_ratio:g}"
    where = ""
    for b, t in enumerate(lengths):
        try:
            make_plan(policy, np.asarray([t]), cfg, budget=st.budget, compression_ratio=st.compression_ratio, **kw)
        except ValueError:
            where = f"row {b} ({int(t)} prompt tokens): "
            break
    return ValueError(f"policy {st.policy_name!r} at {what}: {where}{err}")


def _prefill_runs(model: Model, runs: list[_Run | ValueError], tokens: jax.Array, positions: jax.Array,
                  key: jax.Array, sampler: Sampler, *, bucket: int, capacity: int
                  ) -> Iterator[tuple[jax.Array, KVCache, Any] | None]:
    """One model prefill per RoPE mode (recording what its runs' policies need), then each run's
    compression (or growth to `capacity` for the full cache). Yields per run: first-token ids [B],
    the cache and the policy's decode state (None for runs that are errors). Lazily, so that only
    one run's compressed cache is alive at a time next to the shared prefill."""
    ok = [r for r in runs if isinstance(r, _Run)]
    prefilled = {}
    for mode in dict.fromkeys(steps.rope_mode(r.policy) for r in ok):
        spec = steps.prefill_spec([r.policy for r in ok if steps.rope_mode(r.policy) == mode])
        first, cache, observations, _ = steps.prefill(model.params, tokens, positions, key, cfg=model.config,
                                                      capacity=bucket, observe=spec, rope_mode=mode, sampler=sampler,
                                                      mesh=model.mesh)
        prefilled[mode] = first, cache, observations
    looked: dict[int, jax.Array] = {}  # one lookahead pass per adapter
    for r in runs:
        if not isinstance(r, _Run):
            yield None
            continue
        first, cache, observations = prefilled[steps.rope_mode(r.policy)]
        if r.policy is not None and r.policy.requirements().observe.lookahead:
            adapter = r.policy.lookahead_adapter()
            if id(adapter) not in looked:
                adapter.check_model(model.config)
                check_lookahead_positions(model.config, int(jnp.max(jnp.sum(positions >= 0, axis=-1))), adapter.config)
                looked[id(adapter)] = steps.lookahead(model.params, cache, positions, adapter.params,
                                                      cfg=model.config, config=adapter.config)
            observations = observations.replace(query_mass=looked[id(adapter)])
        if r.policy is None:
            yield first, steps.grow(cache, capacity=capacity, mesh=model.mesh), None
        else:
            yield (first, *steps.compress(cache, observations, r.plan, policy=r.policy, capacity=capacity,
                                          mesh=model.mesh))


def _entries(cache: KVCache) -> jax.Array:
    """KV entries per row, summed over layers and heads: [B] float32."""
    return cache.valid.sum(axis=(0, 2, 3)).astype(jnp.float32)


def _answer(model: Model, batch: Batch, run: _Run, first: jax.Array, cache: KVCache, state: Any,
            key: jax.Array) -> GenerateOutput:
    """Feeds the questions (if any) to a prefilled, compressed cache, then decodes."""
    cfg = model.config
    policy, plan = run.policy, run.plan
    k_question, k_decode = jax.random.split(key)
    kept = _entries(cache)  # on device; fetched at the end so dispatch does not wait for prefill
    pos0 = jnp.asarray(batch.lengths)
    if batch.q_rows:
        logits, cache = steps.feed(model.params, cache, *batch.question_arrays(model.mesh), cfg=cfg, mesh=model.mesh,
                                   rope_mode=steps.rope_mode(policy))
        first = batch.sampler(logits[:, 0], k_question)
        pos0 = jnp.asarray(batch.lengths + batch.q_lengths)
    cache_bytes = cache.nbytes()
    decode_time = policy is not None and policy.decode_time
    final = steps.decode(model.params, cache, state if decode_time else None, first, pos0, k_decode,
                         plan if decode_time else None, jnp.int32(batch.max_new_tokens), cfg=cfg, steps=batch.steps,
                         policy=policy if decode_time else None, sampler=batch.sampler, stop_ids=batch.stop_ids,
                         pad_id=batch.pad_id, mesh=model.mesh, rope_mode=steps.rope_mode(policy))
    out = np.array(jax.device_get(final.tokens))[:, :batch.max_new_tokens]
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
    heads = cfg.num_global_layers * cfg.num_kv_heads
    entry_bytes = 2 * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
    kept, kept_min, kept_max, kept_sum, n, kept_final = (np.asarray(x, np.float64) for x in jax.device_get(
        (kept, final.kept_min, final.kept_max, final.kept_sum, final.active_steps, _entries(final.cache))))
    budget = reached = None
    if run.setting.policy is not None:
        budget = np.asarray(row_budgets(batch.lengths, run.setting.budget, run.setting.compression_ratio,
                                        policy.kvpress_compat), np.int64)
        reached = np.minimum(kept, kept_min) / heads <= budget + 1
    return GenerateOutput(tokens=out, lengths=out_lengths, texts=texts, prompt_lengths=batch.lengths,
                          cache_bytes=cache_bytes, kept=(kept / heads).astype(np.float32),
                          kept_final=(kept_final / heads).astype(np.float32), pad_id=batch.pad_id,
                          kept_peak=kept_max / heads, kept_mean=kept_sum / np.maximum(n, 1) / heads,
                          kv_bytes_peak=(kept_max * entry_bytes).astype(np.int64),
                          kv_bytes_mean=kept_sum / np.maximum(n, 1) * entry_bytes, budget=budget,
                          budget_reached=reached)


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
    `generate(model, prompts, questions=questions, **setting.kwargs(), ...)` with the same `key`.
    on_error: "raise" (default), or "return": a setting that is invalid for these prompts (its
    policy rejects the budget, or a row is too short for it) gets its ValueError, naming the
    policy, the ratio or budget and the row, in its slot, and the others still run.
    """
    batch = prepare(model, prompts, questions=questions, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, chat_template=chat_template, buckets=buckets,
                    question_tokens=question_tokens)
    runs = _plan_runs(model, settings, batch.lengths, bucket=batch.bucket, room=batch.room,
                      question_tokens=batch.q_bucket, on_error=on_error)
    key = jax.random.PRNGKey(0) if key is None else key
    k_prefill, k_rest = jax.random.split(key)
    tokens, positions = batch.prompt_arrays(model.mesh)
    prefilled = _prefill_runs(model, runs, tokens, positions, k_prefill, batch.sampler, bucket=batch.bucket,
                              capacity=batch.bucket + batch.room)
    return [r if p is None else _answer(model, batch, r, *p, k_rest) for r, p in zip(runs, prefilled)]


def generate(
    model: Model,
    prompts: Any,
    *,
    questions: Any = None,
    policy: str | Policy | None = None,
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
    setting = Setting(policy, compression_ratio, budget)
    return generate_settings(model, prompts, [setting], questions=questions, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_tokens=stop_tokens,
                             chat_template=chat_template, buckets=buckets, question_tokens=question_tokens)[0]


def compress(
    model: Model,
    prompts: Any,
    *,
    policy: str | Policy,
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
    if policy is None:
        raise ValueError("compress needs a policy (a registered name or a policy object), got None")
    setting = Setting(policy, compression_ratio, budget)
    batch = prepare(model, prompts, max_new_tokens=1, chat_template=chat_template, buckets=buckets)
    runs = _plan_runs(model, [setting], batch.lengths, bucket=batch.bucket, room=batch.room, question_tokens=0,
                      on_error="raise")
    tokens, positions = batch.prompt_arrays(model.mesh)
    (_, cache, _), = _prefill_runs(model, runs, tokens, positions, jax.random.PRNGKey(0), batch.sampler,
                                   bucket=batch.bucket, capacity=batch.bucket)
    return cache


def continuation_logits(
    model: Model,
    contexts: Any,
    continuations: Any,
    *,
    policy: str | Policy | None = None,
    budget: int | None = None,
    compression_ratio: float | None = None,
    buckets: Sequence[int] = BUCKETS,
) -> list[np.ndarray]:
    """Teacher-forces each continuation after its (compressed) context.

    Returns, per row, float32 logits [len(continuation), V]: row j is the distribution after
    continuation token j (predicting token j+1), read from the cache the policy left. Compare two
    policies' outputs (e.g. against policy=None) for fidelity: next-token KL and top-1 agreement.
    """
    setting = Setting(policy, compression_ratio, budget)
    rows = encode_prompts(model, contexts, what="contexts")
    conts = encode_prompts(model, continuations, what="continuations")
    if len(conts) != len(rows):
        raise ValueError(f"got {len(rows)} contexts but {len(conts)} continuations: give one per context")
    lengths = np.array([len(r) for r in rows], np.int32)
    c_lengths = np.array([len(r) for r in conts], np.int32)
    check_positions(model, int(lengths.max()), int(c_lengths.max()), what="continuation tokens")
    T = bucket_length(int(lengths.max()), buckets)
    n = bucket_length(int(c_lengths.max()), buckets)
    runs = _plan_runs(model, [setting], lengths, bucket=T, room=n, question_tokens=n, on_error="raise")
    tokens, positions = put_batch(model.mesh, *pad_rows(rows, T, pad_id(model)))
    (_, cache, _), = _prefill_runs(model, runs, tokens, positions, jax.random.PRNGKey(0), Sampler(), bucket=T,
                                   capacity=T + n)
    c_tokens, c_pos = pad_rows(conts, n, pad_id(model), offsets=lengths)
    index = np.broadcast_to(np.arange(n, dtype=np.int32), (len(rows), n))
    logits, _ = steps.feed(model.params, cache, *put_batch(model.mesh, c_tokens, c_pos, index), cfg=model.config,
                           mesh=model.mesh, rope_mode=steps.rope_mode(runs[0].policy))
    logits = np.asarray(jax.device_get(logits))
    return [logits[b, : c_lengths[b]] for b in range(len(rows))]
