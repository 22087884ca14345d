"""The public entry points: `generate`, `generate_settings`, `compress`, `continuation_logits`.

One request runs: host-side encoding and bucketing (`inputs`); then, for each sub-batch (rows
grouped by length bucket, `inputs.split_rows`), one jitted model prefill shared by every setting
that needs the same RoPE mode, each setting's jitted compression, the question feed and the jitted
decode loop (`steps`); the sub-batches' outputs are put back in the caller's row order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache_quant, cache_quant_ragged
from kvjax.cache import KVCache
from kvjax.cache_ragged import choose_layout
from kvjax.engine import steps
from kvjax.engine.inputs import (
    BUCKETS,
    Batch,
    bucket_length,
    check_positions,
    chunk_rows,
    encode_prompts,
    pad_id,
    pad_rows,
    prepare,
    prompt_format,
    put_batch,
    split_rows,
)
from kvjax.kv_quant import KVQuant
from kvjax.kv_quant import resolve as resolve_kv_quant
from kvjax.models.config import ModelConfig
from kvjax.models.model import Model
from kvjax.policies import Plan, Policy, resolve
from kvjax.policies.base import PromptFormat, check_budget, row_budgets
from kvjax.policies.registry import canonical_name, check_chunked_prefill, name_of
from kvjax.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to run a batch: the full cache (policy None), or `policy` (a preset name or a policy
    object) at exactly one of `compression_ratio` (the fraction removed, in [0, 1)) or `budget`
    (entries kept per KV head).

    prefill_chunk: None (one-shot prefill), or prefill the prompt `prefill_chunk` tokens at a time,
    evicting down to the budget after each chunk (README, "Chunked prefill"; only policies with
    `supports_chunked_prefill`); the budget or ratio still refers to the whole prompt.
    kv_quant: None (keys and values in the model dtype), a preset name of `kvjax.kv_quant.PRESETS`
    ("int8", "fp8", "int4", "int2", ...) or a `kvjax.kv_quant.KVQuant`: decode from quantized storage
    (the full cache too)."""

    policy: str | Policy | None = None
    compression_ratio: float | None = None
    budget: int | None = None
    prefill_chunk: int | None = None
    kv_quant: str | KVQuant | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_quant", kv_quant_config(self.kv_quant))
        if self.prefill_chunk is not None:
            if isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, (int, np.integer)):
                raise TypeError(f"prefill_chunk must be an int (prompt tokens per chunk) or None, "
                                f"got {self.prefill_chunk!r}")
            if self.prefill_chunk < 1:
                raise ValueError(f"prefill_chunk must be a positive number of prompt tokens, got {self.prefill_chunk}")
            object.__setattr__(self, "prefill_chunk", int(self.prefill_chunk))
        if self.policy is None:
            if self.compression_ratio is not None or self.budget is not None:
                raise ValueError("the full-cache setting (policy=None) takes no compression_ratio or budget: "
                                 "budget / compression_ratio need a policy (policy=None keeps the full cache)")
            if self.prefill_chunk is not None:
                raise ValueError("the full-cache setting (policy=None) takes no prefill_chunk: chunked prefill "
                                 "evicts after every chunk, which needs a policy")
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
        """``full``, ``r=0.5`` or ``C=128``, followed by the storage when quantized (``r=0.5 int4``)."""
        base = "full" if self.policy is None else (
            f"r={self.compression_ratio:g}" if self.compression_ratio is not None else f"C={self.budget}")
        return base if self.kv_quant is None else f"{base} {self.kv_quant.name}"

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `generate` (prefill_chunk and kv_quant only when set)."""
        kw = {"policy": self.policy, "compression_ratio": self.compression_ratio, "budget": self.budget}
        if self.prefill_chunk is not None:
            kw["prefill_chunk"] = self.prefill_chunk
        if self.kv_quant is not None:
            kw["kv_quant"] = self.kv_quant
        return kw


def kv_quant_config(kv_quant: str | KVQuant | None) -> KVQuant | None:
    """`kvjax.kv_quant.resolve`, with the error naming the argument."""
    try:
        return resolve_kv_quant(kv_quant)
    except ValueError as err:
        raise ValueError(f"kv_quant: {err}") from None


@dataclasses.dataclass
class GenerateOutput:
    """tokens [B, max_new_tokens] int32 (padded with `pad_id` after a stop token);
    lengths [B]: generated tokens per row, the stop token included; texts: decoded answers
    (None without a tokenizer); prompt_lengths [B]; cache_bytes: allocated bytes of the decode caches
      of all rows: a batch split into sub-batches (rows in several buckets) sums its sub-batches'
      caches, copies that fill a sub-batch up to the mesh's data axis included; the sub-batches run
      one after another, so only one of those caches is alive at a time;
    kept [B]: KV entries kept per (layer, head) after prefill compression, averaged over layers and heads
      (layers: those a policy acts on, i.e. Gemma's global layers; its sliding-window buffers are not counted);
    kept_final [B]: the same at the end of decoding (decode-time policies evict as they go);
    kept_peak / kept_mean [B]: the most and the mean entries per (layer, head) the cache held while
      the row decoded (after the question, and after each generated token's step);
    kv_bytes_peak / kv_bytes_mean [B]: the key/value bytes of those entries, over all layers and heads, in
      the model dtype; kv_bytes16_peak / kv_bytes16_mean [B]: the same at 16 bits per element, as a
      bf16 cache holds them (a quantized cache: its codes, scales and zero points, and the window's
      entries at 16 bits): the equal-memory axis;
    budget [B]: the setting's nominal entries per KV head for each row (kvpress's int(T*(1-r)) for a
      ratio), None for the full cache; budget_reached [B]: whether the cache held at most that many
      entries (+1 for the decode write) at some point, i.e. whether the policy really compressed;
    cache_layout: the layout decoding read: "dense", "ragged" (`kvjax.cache_ragged`), "quantized" (the
      stacked `kvjax.cache_quant.QuantizedKVCache`) or "ragged+quantized" (`kvjax.cache_quant_ragged`: the
      ragged layout's per-layer storage, quantized)."""

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
    cache_layout: str = "dense"
    kv_bytes16_peak: np.ndarray | None = None
    kv_bytes16_mean: np.ndarray | None = None


CACHE_LAYOUTS = ("dense", "ragged")
# Kept counts are rounded up to a multiple of this per layer (and per row total for segmented layers)
# when the ragged layout is sized, so that calls whose counts differ a little share one compilation.
RAGGED_GRANULE = 16


def check_cache_layout(cache_layout: str) -> None:
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")


def reuses_slots(config: KVQuant) -> bool:
    """Whether decode-time eviction over `config`'s storage writes into the slots it frees (per-token
    scales; `kvjax.cache_quant`), so that the dense plan's capacity suffices."""
    return cache_quant.key_group(config) == 1


def ragged_supported(model: Model, policy: Policy | None) -> bool:
    """Whether a run decodes in the ragged layout when asked (`cache_layout="ragged"`): a policy without
    decode-time eviction, in rope_mode "original". Other runs keep the dense layout (the stacked
    quantized one with kv_quant)."""
    return policy is not None and not policy.decode_time and steps.rope_mode(policy) == "original"


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


@dataclasses.dataclass
class _Part:
    """One sub-batch of a request: the caller's index of each of its rows [b] (a row may repeat:
    copies that fill the sub-batch up), their prompt lengths [b], and the shapes its plans use."""

    index: np.ndarray
    lengths: np.ndarray
    bucket: int
    room: int
    question_tokens: int

    @classmethod
    def of(cls, index: np.ndarray, batch: Batch) -> _Part:
        return cls(index, batch.lengths, batch.bucket, batch.room, batch.q_bucket)

    def plan(self, policy: Policy, st: Setting, cfg: ModelConfig, rows: slice = slice(None)) -> Plan:
        """`make_plan` for this sub-batch's `rows`."""
        return make_plan(policy, self.lengths[rows], cfg, budget=st.budget, compression_ratio=st.compression_ratio,
                         bucket=self.bucket, room=self.room, question_tokens=self.question_tokens)


def _for_prompts(st: Setting, fmt: PromptFormat | None) -> Policy | ValueError | None:
    """The setting's policy for this batch's prompt format (`Policy.for_prompts`), or its refusal."""
    if st.policy is None:
        return None
    policy = resolve(st.policy)  # an unknown name raises here, whatever on_error says
    try:
        return policy.for_prompts(fmt)
    except ValueError as err:
        return err


def _plan_runs(model: Model, settings: Sequence[Setting], parts: list[_Part], *, on_error: str,
               fmt: PromptFormat | None = None) -> list[list[_Run | ValueError]]:
    """Resolves and plans every setting for every sub-batch: [part][setting]. Each policy is first
    fitted to the request's prompt format `fmt` (`Policy.for_prompts`: KVzip's kvpress passes on
    chat-templated prompts). A setting its policy rejects for some rows (a budget below what it
    protects, a row too short, a batch mixing chat-templated and raw prompts) raises, or with
    on_error="return" takes the error's place in every sub-batch."""
    if on_error not in ("raise", "return"):
        raise ValueError(f"on_error must be 'raise' or 'return', got {on_error!r}")
    settings = [st if isinstance(st, Setting) else Setting(*st) for st in settings]
    resolved = [_for_prompts(st, fmt) for st in settings]
    table = [[p if isinstance(p, ValueError) else _plan(model.config, st, p, part)
              for st, p in zip(settings, resolved)] for part in parts]
    for s, (st, policy) in enumerate(zip(settings, resolved)):
        err = next((row[s] for row in table if isinstance(row[s], ValueError)), None)
        if err is None:
            continue
        if isinstance(policy, ValueError):
            what = f"budget={st.budget}" if st.budget is not None else f"compression_ratio={st.compression_ratio:g}"
            err = ValueError(f"policy {st.policy_name!r} at {what}: {policy}")
        else:
            err = _plan_error(policy, st, parts, model.config, err)
        if on_error == "raise":
            raise err from None
        for row in table:
            row[s] = err
    return table


def _plan(cfg: ModelConfig, st: Setting, policy: Policy | None, part: _Part) -> _Run | ValueError:
    """The setting's run on one sub-batch, or the ValueError its policy raises for these rows."""
    if policy is None:
        return _Run(st, None, None)
    if st.kv_quant is not None and steps.rope_mode(policy) != "original":
        return ValueError(f"kv_quant={st.kv_quant.name!r} stores keys rotated at their positions, but this policy "
                          f"decodes in rope_mode {steps.rope_mode(policy)!r} (keys rotated again at their rank in "
                          "the cache at every step), which a quantized cache does not do; run it with kv_quant=None")
    try:
        if st.prefill_chunk is not None:
            check_chunked_prefill(policy, st.prefill_chunk)
        plan = part.plan(policy, st, cfg)
        if st.kv_quant is not None and policy.decode_time and not reuses_slots(st.kv_quant):
            # per-channel key groups need consecutive slots: each decode token goes to its head's next slot
            # rather than the one an eviction freed, so the cache has room for every step
            plan = plan.replace(capacity=plan.capacity + part.room - part.question_tokens)
        return _Run(st, policy, plan)
    except ValueError as err:
        return err


def _plan_error(policy: Policy, st: Setting, parts: list[_Part], cfg: ModelConfig, err: ValueError) -> ValueError:
    """The policy's refusal of a batch, naming the policy, the ratio or budget, and the first row
    (in the caller's order) that it refuses on its own (its index and length)."""
    what = f"budget={st.budget}" if st.budget is not None else f"compression_ratio={st.compression_ratio:g}"
    where = ""
    for b, j, i in sorted((int(b), j, i) for j, part in enumerate(parts) for i, b in enumerate(part.index)):
        try:
            parts[j].plan(policy, st, cfg, slice(i, i + 1))
        except ValueError:
            where = f"row {b} ({int(parts[j].lengths[i])} prompt tokens): "
            break
    return ValueError(f"policy {st.policy_name!r} at {what}: {where}{err}")


def _chunked(run: _Run | ValueError) -> bool:
    return isinstance(run, _Run) and run.policy is not None and run.setting.prefill_chunk is not None


def _chunked_prefill(model: Model, run: _Run, rows: list[list[int]], pad: int, key: jax.Array,
                     sampler: Sampler) -> tuple[jax.Array, KVCache, Any]:
    """The run's chunked prefill: the prompts fed `prefill_chunk` tokens at a time (`chunk_rows`,
    aligned on each prompt's end) into a cache of the plan's capacity + chunk slots, evicting after
    every chunk (`steps.prefill_chunk`, one compiled program for every chunk), then moved into a
    cache of the plan's capacity. Returns first-token ids [B], the cache and the decode state."""
    chunk, policy, plan, cfg = run.setting.prefill_chunk, run.policy, run.plan, model.config
    tokens, positions = chunk_rows(rows, chunk, pad)
    cache = steps.empty_cache(cfg=cfg, batch=len(rows), capacity=plan.capacity + chunk, mesh=model.mesh)
    spec = steps.chunk_spec(policy)
    carried = spec.chunk_init(cache.valid)
    seen = jnp.zeros((len(rows),), jnp.int32)
    for c in range(tokens.shape[0]):
        tc, pc = put_batch(model.mesh, tokens[c], positions[c])
        logits, cache, carried, seen, slot_state = steps.prefill_chunk(
            model.params, cache, carried, seen, tc, pc, plan, cfg=cfg, policy=policy, observe=spec,
            rope_mode=steps.rope_mode(policy), mesh=model.mesh)
    first = sampler(logits, key)  # every row's last prompt token is in the last chunk
    return (first, *steps.finish_chunks(cache, slot_state, plan, policy=policy, mesh=model.mesh))


def _prefill_runs(model: Model, runs: list[_Run | ValueError], tokens: jax.Array, positions: jax.Array,
                  key: jax.Array, sampler: Sampler, *, bucket: int, capacity: int,
                  rows: list[list[int]] | None = None, pad: int = 0
                  ) -> Iterator[tuple[jax.Array, KVCache, Any] | None]:
    """One model prefill per RoPE mode (recording what its runs' policies need), then each run's
    compression (or growth to `capacity` for the full cache). Yields per run: first-token ids [B],
    the cache and the policy's decode state (None for runs that are errors). Lazily, so that only
    one run's compressed cache is alive at a time next to the shared prefill.
    Runs with a `prefill_chunk` prefill on their own (`_chunked_prefill`, from the prompts `rows`
    padded with `pad`); the shared prefill runs only if some other run needs it."""
    ok = [r for r in runs if isinstance(r, _Run) and not _chunked(r)]
    prefilled = {}
    produced: dict[tuple[Any, ...], tuple[Any, dict[str, jax.Array]]] = {}
    for mode in dict.fromkeys(steps.rope_mode(r.policy) for r in ok):
        policies = [r.policy for r in ok if steps.rope_mode(r.policy) == mode]
        spec = steps.prefill_spec(policies)
        riding = _riding_pass(model, policies, mode, positions)
        first, cache, observations, _ = steps.prefill(
            model.params, tokens, positions, key, cfg=model.config, capacity=bucket, observe=spec, rope_mode=mode,
            sampler=sampler, mesh=model.mesh, riding=None if riding is None else riding[0],
            riding_inputs=None if riding is None else riding[1])
        if riding is not None:  # shared with the runs that ask for this pass, as `_produced` would
            o, inputs = riding
            produced[(o, id(inputs), mode)] = inputs, {f: getattr(observations, f) for f in o.fields
                                                       if getattr(observations, f) is not None}
        prefilled[mode] = first, cache, observations
    for r in runs:
        if not isinstance(r, _Run):
            yield None
            continue
        if _chunked(r):
            yield _chunked_prefill(model, r, rows, pad, key, sampler)
            continue
        first, cache, observations = prefilled[steps.rope_mode(r.policy)]
        if r.policy is None:
            yield first, steps.grow(cache, capacity=capacity, mesh=model.mesh), None
            continue
        observations = _produced(model, r.policy, cache, tokens, positions, observations, produced)
        yield (first, *steps.compress(cache, observations, r.plan, policy=r.policy, capacity=capacity,
                                      mesh=model.mesh))


def _riding_pass(model: Model, policies: list[Policy | None], mode: str, positions: jax.Array
                 ) -> tuple[Any, Any] | None:
    """`steps.riding_pass`, its host-side checks passed."""
    riding = steps.riding_pass(policies, mode)
    if riding is not None:
        riding[0].check(model.config, int(jnp.max(jnp.sum(positions >= 0, axis=-1))), riding[1])
    return riding


def _produced(model: Model, policy: Policy, cache: KVCache, tokens: jax.Array, positions: jax.Array,
              observations: Any, memo: dict[tuple[Any, ...], tuple[Any, dict[str, jax.Array]]]) -> Any:
    """`observations` with the fields of the passes the policy's spec asks for after the prefill (its
    producers), each run once per (observation, policy inputs, RoPE mode) and shared through `memo`."""
    inputs = policy.observation_inputs()
    mode = steps.rope_mode(policy)
    for o in policy.requirements().observe.producers:
        key = (o, id(inputs), mode)
        if key not in memo:
            o.check(model.config, int(jnp.max(jnp.sum(positions >= 0, axis=-1))), inputs)
            memo[key] = inputs, steps.produce(model.params, cache, tokens, positions, inputs, cfg=model.config,
                                              observation=o, rope_mode=mode)
        observations = observations.replace(**memo[key][1])
    return observations


_entries = steps.row_entries


def _answer(model: Model, batch: Batch, run: _Run, first: jax.Array, cache: KVCache, state: Any,
            key: jax.Array, cache_layout: str = "dense") -> GenerateOutput:
    """Feeds the questions (if any) to a prefilled, compressed cache, then decodes (in the ragged
    layout when asked and `ragged_supported`: the cache after the question is moved into
    per-layer storage sized to what it holds plus the decode room, quantized when the setting's
    kv_quant is set; otherwise, with kv_quant, from the stacked quantized cache)."""
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
    layout, quant = "dense", run.setting.kv_quant
    if quant is not None:  # scored and compacted in full precision; quantized once, below
        quant.check(cfg.head_dim)
    if cache_layout == "ragged" and ragged_supported(model, policy):
        counts = np.asarray(jax.device_get(cache.num_valid()))
        room = batch.steps  # decode writes at most steps - 1 tokens
        if quant is None:
            sizes, layout = choose_layout(counts, room, RAGGED_GRANULE), "ragged"
        else:
            sizes, layout = cache_quant_ragged.choose_layout(counts, room, quant, RAGGED_GRANULE), \
                cache_quant_ragged.LAYOUT_NAME
        cache = steps.to_ragged(cache, layout=sizes, room=room, kv_quant=quant)
    elif quant is not None:
        cache = steps.to_quantized(cache, config=quant, room=batch.steps,  # decode writes at most steps - 1
                                   reuse_slots=policy is not None and policy.decode_time and reuses_slots(quant))
        layout = "quantized"
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
    kept, kept_min, kept_max, kept_sum, n, kept_final, bytes_max, bytes_sum = (
        np.asarray(x, np.float64) for x in jax.device_get((kept, final.kept_min, final.kept_max, final.kept_sum,
                                                           final.active_steps, _entries(final.cache), final.bytes_max,
                                                           final.bytes_sum)))
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
                          budget_reached=reached, cache_layout=layout, kv_bytes16_peak=bytes_max.astype(np.int64),
                          kv_bytes16_mean=bytes_sum / np.maximum(n, 1))


def _merge(outs: list[GenerateOutput], parts: list[np.ndarray], B: int) -> GenerateOutput:
    """The sub-batches' outputs as one, in the caller's row order: part j's row i is the caller's
    row parts[j][i] (copies after its first occurrence dropped); cache_bytes summed."""
    if len(outs) == 1 and np.array_equal(parts[0], np.arange(B)):
        return outs[0]
    where: dict[int, tuple[int, int]] = {}
    for j, index in enumerate(parts):
        for i, b in enumerate(index):
            where.setdefault(int(b), (j, i))
    order = [where[b] for b in range(B)]
    fields = {}
    for f in dataclasses.fields(GenerateOutput):
        values = [getattr(o, f.name) for o in outs]
        if f.name == "cache_bytes":
            fields[f.name] = sum(values)
        elif f.name in ("pad_id", "cache_layout") or values[0] is None:
            fields[f.name] = values[0]
        elif isinstance(values[0], list):
            fields[f.name] = [values[j][i] for j, i in order]
        else:
            fields[f.name] = np.stack([np.asarray(values[j])[i] for j, i in order])
    return GenerateOutput(**fields)


def _data_size(model: Model) -> int:
    """Devices along the mesh's `data` axis (the batch is sharded over it); 1 without a mesh."""
    return 1 if model.mesh is None else int(dict(model.mesh.shape).get("data", 1))


def _sub_batches(model: Model, batch: Batch, split: str | None) -> list[tuple[np.ndarray, Batch]]:
    """(caller's row index [b], sub-batch) pairs: `split_rows`, sub-batch sizes a multiple of the
    mesh's data axis when a mesh is set."""
    parts = split_rows(batch.lengths, batch.buckets, split, _data_size(model))
    if len(parts) == 1 and len(parts[0]) == len(batch.rows):
        return [(parts[0], batch)]
    return [(index, batch.take(index)) for index in parts]


def _generate_part(model: Model, batch: Batch, runs: list[_Run | ValueError], key: jax.Array,
                   cache_layout: str = "dense") -> list[GenerateOutput | ValueError]:
    """Every run on one (sub-)batch, sharing its model prefill."""
    k_prefill, k_rest = jax.random.split(key)
    tokens, positions = batch.prompt_arrays(model.mesh)
    prefilled = _prefill_runs(model, runs, tokens, positions, k_prefill, batch.sampler, bucket=batch.bucket,
                              capacity=batch.bucket + batch.room, rows=batch.rows, pad=batch.pad_id)
    return [r if p is None else _answer(model, batch, r, *p, k_rest, cache_layout) for r, p in zip(runs, prefilled)]


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
    decode_tokens: int = 0,
    on_error: str = "raise",
    split: str | None = "bucket",
    prefill_chunk: int | None = None,
    cache_layout: str = "dense",
    kv_quant: str | KVQuant | None = None,
) -> list[GenerateOutput | ValueError]:
    """`generate` for one batch under several settings, sharing the model prefill between them.

    The prefill runs once per sub-batch (see `split` in `generate`) and RoPE mode among the
    settings, recording the union of what their policies observe (the widest window, column mass
    if any needs it); each setting then compresses its own copy of that cache. Returns one output
    per setting, each equal to `generate(model, prompts, questions=questions, **setting.kwargs(), ...)`
    with the same `key`.
    on_error: "raise" (default), or "return": a setting that is invalid for these prompts (its
    policy rejects the budget, or a row is too short for it) gets its ValueError, naming the
    policy, the ratio or budget and the row, in its slot, and the others still run.
    prefill_chunk: the chunk of every setting with a policy and no `prefill_chunk` of its own (see
    `generate`); the full-cache setting keeps its one-shot prefill, and chunked settings prefill on
    their own (they share no prefill).
    cache_layout: as in `generate`.
    kv_quant: the storage of every setting without a `kv_quant` of its own (see `generate`).
    """
    check_cache_layout(cache_layout)
    settings = [st if isinstance(st, Setting) else Setting(*st) for st in settings]
    if prefill_chunk is not None:
        settings = [dataclasses.replace(st, prefill_chunk=prefill_chunk)
                    if st.policy is not None and st.prefill_chunk is None else st for st in settings]
    if kv_quant is not None:
        settings = [dataclasses.replace(st, kv_quant=kv_quant) if st.kv_quant is None else st for st in settings]
    batch = prepare(model, prompts, questions=questions, max_new_tokens=max_new_tokens, temperature=temperature,
                    top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, chat_template=chat_template, buckets=buckets,
                    question_tokens=question_tokens, decode_tokens=decode_tokens)
    subs = _sub_batches(model, batch, split)
    table = _plan_runs(model, settings, [_Part.of(index, sub) for index, sub in subs], on_error=on_error,
                       fmt=prompt_format(model, batch.rows))
    key = jax.random.PRNGKey(0) if key is None else key
    outs = [_generate_part(model, sub, runs, key if len(subs) == 1 else jax.random.fold_in(key, j), cache_layout)
            for j, ((_, sub), runs) in enumerate(zip(subs, table))]
    index = [i for i, _ in subs]
    return [table[0][s] if isinstance(table[0][s], ValueError) else _merge([o[s] for o in outs], index, len(batch.rows))
            for s in range(len(table[0]))]


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
    decode_tokens: int = 0,
    split: str | None = "bucket",
    prefill_chunk: int | None = None,
    cache_layout: str = "dense",
    kv_quant: str | KVQuant | None = None,
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
    decode_tokens: compile the decode loop (and the cache's decode room) for at least this many new
      tokens, so that calls with different `max_new_tokens` share one compiled program; the loop
      still stops at `max_new_tokens` (answers are unchanged).
    split: "bucket" (default): prompts in different length buckets run as separate sub-batches, one
      after another, each padded only to its own bucket (and its questions to their own question
      bucket), in sub-batches of a power of two rows (times the mesh's data axis) so that a bucket
      compiles few batch sizes (`kvjax.engine.inputs.split_rows`); outputs come back in the
      caller's order. A batch whose prompts share one bucket runs as one batch, as does every
      batch with split=None (all rows padded to the longest prompt's bucket, one program).
      Greedy answers are the same either way: each row's equal what the prompt gives alone. With
      temperature > 0 a row's draws depend on the batch it is sampled in (as they always have):
      a split batch's sub-batch j samples with `jax.random.fold_in(key, j)`, so the same call
      gives the same result, but a row's draws change with the other rows of the call.
    prefill_chunk: None (default) prefills each prompt in one pass, then compresses. An int N (with a
      policy that supports it: `Policy.supports_chunked_prefill`, `policies.registry.chunked_presets()`)
      feeds the prompt N tokens at a time into a cache of the policy's kept capacity + N slots and
      evicts down to the budget after every chunk, so the cache never holds more than budget + N
      (+ decode room) entries per head; `budget` / `compression_ratio` refer to the whole prompt.
      Chunks are aligned on each prompt's end; every chunk reuses one compiled program. Scores
      differ from the one-shot prefill's: see the README, "Chunked prefill".
    cache_layout: "dense" (default): decode over the `[L, B, Hkv, C, D]` cache, whose capacity C is
      the largest count of any layer and head plus the decode room. "ragged" (opt-in): after the
      prompt's compression and the question, move the cache into per-layer storage that holds only
      what is kept plus the decode room (`kvjax.cache_ragged`: a capacity per layer for layer-wise
      budgets, per-head segments for head-wise ones) and decode over that; greedy answers are the
      same. Used for policies without decode-time eviction in rope_mode "original" (the others stay
      dense); Gemma's sliding-window layers keep their rolling buffers; the output's `cache_layout`
      says which ran. Its sizes are read from the kept counts on the host (one sync
      per run), rounded up to `RAGGED_GRANULE`; each distinct layout is one compilation. With
      `kv_quant` the ragged storage is quantized (`kvjax.cache_quant_ragged`; `cache_layout` reports
      "ragged+quantized"): per layer, codes and scales for the kept entries plus the decode room, and
      a full-precision window of min(residual, decode room) entries per head; with per-token scales
      greedy answers are the stacked quantized layout's (the same entries get the same codes), in fewer
      bytes (per-channel keys group entries in position order, so their codes may differ).
    kv_quant: None (default: keys and values in the model dtype), a preset name of `kvjax.kv_quant.PRESETS`
      ("int8", "fp8", "int4", "int4_g32", "int4_kivi", "int2", "int2_hadamard", "int2_kivi", "bf16") or a
      `kvjax.kv_quant.KVQuant` (format, key axis, group, full-precision window, rotation): after the
      prompt is scored and compressed in full precision (and the question fed), the kept entries are
      quantized once and decoding reads them from codes (`kvjax.cache_quant`; `cache_layout` then
      reports "quantized", or "ragged+quantized" with cache_layout="ragged" where the ragged layout
      runs). Decode appends go to a full-precision window, flushed when full. Gemma's
      sliding-window layers keep their rolling buffers in the model dtype (only the global layers are
      quantized). Decode-time policies evict as on the dense cache (the entries held stay within the
      budget) and, with per-token scales, write each decode token into a slot an eviction freed, so
      the cache has the dense run's capacity; with per-channel key groups (KIVI) appends take each
      head's next slot and the cache has room for every decode step. Policies in rope_mode
      "cache_relative" (streaming_llm) are refused.
    """
    setting = Setting(policy, compression_ratio, budget, prefill_chunk, kv_quant)
    return generate_settings(model, prompts, [setting], questions=questions, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_tokens=stop_tokens,
                             chat_template=chat_template, buckets=buckets, question_tokens=question_tokens,
                             decode_tokens=decode_tokens, split=split, cache_layout=cache_layout)[0]


def compress(
    model: Model,
    prompts: Any,
    *,
    policy: str | Policy,
    budget: int | None = None,
    compression_ratio: float | None = None,
    chat_template: bool = False,
    buckets: Sequence[int] = BUCKETS,
    prefill_chunk: int | None = None,
) -> KVCache:
    """Prefills `prompts` and compresses the cache with `policy`, without decoding: which entries
    each layer and KV head kept. Arguments as in `generate`; the batch is never split (one cache
    holds every row, padded to the longest prompt's bucket).

    Returns the cache: k, v [L, B, Hkv, C, D]; pos [L, B, Hkv, C] (the prompt position of each slot)
    and valid [L, B, Hkv, C] (kept), over the C slots the policy compacts into.
    prefill_chunk: prefill in chunks of that many tokens, evicting after each (as in `generate`).
    """
    if policy is None:
        raise ValueError("compress needs a policy (a registered name or a policy object), got None")
    setting = Setting(policy, compression_ratio, budget, prefill_chunk)
    batch = prepare(model, prompts, max_new_tokens=1, chat_template=chat_template, buckets=buckets)
    (runs,) = _plan_runs(model, [setting], [_Part.of(np.arange(len(batch.rows)), batch)], on_error="raise",
                         fmt=prompt_format(model, batch.rows))
    tokens, positions = batch.prompt_arrays(model.mesh)
    (_, cache, _), = _prefill_runs(model, runs, tokens, positions, jax.random.PRNGKey(0), batch.sampler,
                                   bucket=batch.bucket, capacity=batch.bucket, rows=batch.rows, pad=batch.pad_id)
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
    split: str | None = "bucket",
    prefill_chunk: int | None = None,
) -> list[np.ndarray]:
    """Teacher-forces each continuation after its (compressed) context.

    Returns, per row, float32 logits [len(continuation), V]: row j is the distribution after
    continuation token j (predicting token j+1), read from the cache the policy left. Compare two
    policies' outputs (e.g. against policy=None) for fidelity: next-token KL and top-1 agreement.
    split: as in `generate` (contexts in different buckets run as separate sub-batches).
    prefill_chunk: prefill the contexts in chunks, evicting after each (as in `generate`).
    """
    setting = Setting(policy, compression_ratio, budget, prefill_chunk)
    rows = encode_prompts(model, contexts, what="contexts")
    conts = encode_prompts(model, continuations, what="continuations")
    if len(conts) != len(rows):
        raise ValueError(f"got {len(rows)} contexts but {len(conts)} continuations: give one per context")
    lengths = np.array([len(r) for r in rows], np.int32)
    check_positions(model, int(lengths.max()), int(max(len(c) for c in conts)), what="continuation tokens")
    out: dict[int, np.ndarray] = {}
    for index in split_rows(lengths, buckets, split, _data_size(model)):
        logits = _continuation_part(model, setting, [rows[i] for i in index], [conts[i] for i in index], buckets)
        for i, b in enumerate(index):
            out.setdefault(int(b), logits[i])
    return [out[b] for b in range(len(rows))]


def _continuation_part(model: Model, setting: Setting, rows: list[list[int]], conts: list[list[int]],
                       buckets: Sequence[int]) -> list[np.ndarray]:
    """`continuation_logits` of one (sub-)batch: per row, logits [len(continuation), V]."""
    lengths = np.array([len(r) for r in rows], np.int32)
    c_lengths = np.array([len(r) for r in conts], np.int32)
    T = bucket_length(int(lengths.max()), buckets)
    n = bucket_length(int(c_lengths.max()), buckets)
    part = _Part(np.arange(len(rows)), lengths, bucket=T, room=n, question_tokens=n)
    (runs,) = _plan_runs(model, [setting], [part], on_error="raise", fmt=prompt_format(model, rows))
    tokens, positions = put_batch(model.mesh, *pad_rows(rows, T, pad_id(model)))
    (_, cache, _), = _prefill_runs(model, runs, tokens, positions, jax.random.PRNGKey(0), Sampler(), bucket=T,
                                   capacity=T + n, rows=rows, pad=pad_id(model))
    c_tokens, c_pos = pad_rows(conts, n, pad_id(model), offsets=lengths)
    index = np.broadcast_to(np.arange(n, dtype=np.int32), (len(rows), n))
    logits, _ = steps.feed(model.params, cache, *put_batch(model.mesh, c_tokens, c_pos, index), cfg=model.config,
                           mesh=model.mesh, rope_mode=steps.rope_mode(runs[0].policy))
    logits = np.asarray(jax.device_get(logits))
    return [logits[b, : c_lengths[b]] for b in range(len(rows))]
