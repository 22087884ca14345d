"""Policy protocol, plan, selection primitive and kvpress budget arithmetic (policies.md §1).

The engine calls, in order (shapes: L layers, B rows, Hkv KV heads, C slots, G = Hq // Hkv):

    plan  = policy.plan(lengths, L, Hkv, budget=..., compression_ratio=..., max_new_tokens=...)  # host
    cache, state = compress_prefill(policy, plan, cache, obs, capacity=...)                       # jit:
        keep, slot_state = policy.prefill_keep(plan, cache, obs)         # keep [L,B,Hkv,C] bool
        cache, src = cache.compact(keep, plan.capacity)                  # (or cache.evict(keep))
        state = policy.init_decode(plan, cache, gather_slots(slot_state, src))
    each step t = 1, 2, ...: write the token, attend with the un-evicted cache, then, for policies
    whose requirements() say decode_eviction:
    state, keep = policy.decode_step(plan, state, cache, obs, written, t); cache = cache.evict(keep)
    (decode_step hands `decode_update` the step probabilities of `obs`)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, gather_slots
from kvjax.observations import Observations, ObservationSpec

# kvpress versions whose budget arithmetic a policy can follow (policies.md §1.1): 0.5.4 computes
# n_kept = int(T*(1-r)); 0.5.5 and main keep at least one entry, max(1, int(T*(1-r))), and clamp
# Ada-KV's per-head safeguard to max(1, n_safe).
KVPRESS_COMPAT = ("0.5.4", "0.5.5", "main")


# ----------------------------------------------------------------------------- protocol types


@dataclasses.dataclass(frozen=True)
class Requirements:
    """What a policy needs from the model and the decode loop.

    observe: what the prefill (and each decode step) must record (`ObservationSpec`: window
      queries, column mass, step probabilities).
    decode_eviction: whether the policy evicts while decoding, i.e. `decode_update` runs after
      every step's attention (it receives the step probabilities only if `observe.step_probs`).
    rope_mode: "original" (keys keep their rotation at their original position) or
      "cache_relative" (StreamingLLM: keys are cached un-rotated and rotated at their rank among
      the kept entries at every step; the query at its own rank).
    """

    observe: ObservationSpec = ObservationSpec()
    decode_eviction: bool = False
    rope_mode: str = "original"

    def merge(self, other: "Requirements") -> "Requirements":
        """A scorer's and an allocator's needs together."""
        return Requirements(
            observe=self.observe.merge(other.observe),
            decode_eviction=self.decode_eviction or other.decode_eviction,
            rope_mode=self.rope_mode if self.rope_mode != "original" else other.rope_mode,
        )


@struct.dataclass(frozen=True, kw_only=True)
class AllocData:
    """Base of an allocator's plan data (`Plan.alloc`): named [L][B] tuples, leaves of the plan's pytree.

    compressed: [L][B] bool, whether the allocator compresses (layer, row) at all; where False the
      row keeps its whole prompt in that layer and the subclass's other fields there are 0.
    """

    compressed: tuple[tuple[bool, ...], ...] = ()


@struct.dataclass
class DecodeState:
    """Base of a decode-time policy's state, carried through the decode loop (a pytree of arrays).

    Policies that carry nothing between steps (StreamingLLM, TOVA, prefill-only ones) use this empty
    one; the others subclass it with one named field per array (`H2OState`, `LazyState`, `CakeState`).
    """


@struct.dataclass(frozen=True, kw_only=True)
class Plan:
    """Host-side decisions for one batch: hashable (a jit static argument) and a pytree.

    The integer (and bool) tuples are pytree leaves, so the plan may also be passed to `jit` as a
    traced argument (one compile per bucket instead of per length tuple); `capacity`, `compact` and
    `max_new_tokens` are static metadata either way.

    lengths:       [B] real prompt lengths T_b.
    counts:        [L][B] prompt tokens kept per KV head, protected tokens included. Exact for
                   uniform and per-layer budgets; the nominal per-head average for head- or
                   data-adaptive allocators (Ada-KV, Global, CAKE), which read `alloc` as well.
    alloc:         the allocator's own data (`AdaData`, `GlobalData`, `CakeData` in `allocators`),
                   None for the static allocators (Uniform, Pyramid) and for policies without one.
                   One typed field rather than one optional field per meaning on Plan: a new
                   allocator defines its own struct without changing Plan, which every policy reads.
    decode_budget: [B] per-head entries kept after each decode-time eviction (() if none).
    capacity:      slots per (layer, row, head) the cache needs after prefill, decode room included.
    compact:       False when prefill evicts nothing (keep == valid), so the gather may be skipped.
    """

    lengths: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]
    alloc: AllocData | None = None
    decode_budget: tuple[int, ...] = ()
    capacity: int = struct.field(pytree_node=False, default=0)
    compact: bool = struct.field(pytree_node=False, default=True)
    max_new_tokens: int = struct.field(pytree_node=False, default=0)


def as_i32(x: Any) -> jax.Array:
    """A plan field (static tuple or traced leaves) as an int32 array."""
    return jnp.asarray(x, dtype=jnp.int32)


def as_bool(x: Any) -> jax.Array:
    """A bool plan field (static tuple or traced leaves) as a bool array."""
    return jnp.asarray(x, dtype=jnp.bool_)


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a batch's prompts were written, as the engine knows it from the model's tokenizer (host side;
    `kvjax.engine.inputs.prompt_format`), for policies whose passes add tokens of their own (KVzip's
    repeat instructions). A policy never sees the tokenizer itself.

    prefix_ids: the chat template's tokens before a user turn's content (system turn, user header), and
      suffix_ids: those after it (end of turn, assistant header), both as kvpress 0.5.5 finds them
      (`apply_chat_template` of a dummy turn, cut around the content);
    templated [B]: whether each prompt starts with prefix_ids (and goes on after them): chat-templated;
    encode: plain text -> token ids, no special tokens added (the tokenizer's `encode`)."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    templated: tuple[bool, ...]
    encode: Callable[[str], tuple[int, ...]] = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """Base of every policy: a frozen dataclass of hyperparameters plus pure functions.

    query_aware: whether the eval compresses the prompt with the question (paper presets) or the
      context alone (kvpress presets, policies.md §1.3). Read by the engine, not by the policy.
    kvpress_compat: "0.5.4" (plain int(T*(1-r))), or "0.5.5" / "main" (max(1, int(T*(1-r)))),
      policies.md §1.1; the *_kvpress presets follow 0.5.5.
    name: the preset of the class's default hyperparameters (`policies.get(cls.name) == cls()`);
      reports name an object by its preset, or by the nearest one and what differs
      (`policies.registry.name_of`, e.g. "snapkv(window=16)").
    """

    name: ClassVar[str] = "policy"
    # Chunked prefill (README, "Chunked prefill"): None when the policy can score the cache after every
    # chunk of the prompt (its `prefill_keep` on that chunk's observations, over the surviving entries),
    # else the reason it cannot, quoted in the engine's error.
    chunked_prefill_reason: ClassVar[str | None] = "its prefill scores are defined on the whole prompt only"

    query_aware: bool = True
    kvpress_compat: str = "0.5.4"

    def __post_init__(self) -> None:
        check_choice("kvpress_compat", self.kvpress_compat, KVPRESS_COMPAT)
        check_bool("query_aware", self.query_aware)

    @property
    def decode_time(self) -> bool:
        """Whether the policy evicts during decoding."""
        return self.requirements().decode_eviction

    def requirements(self) -> Requirements:
        return Requirements()

    def chunked_prefill_unsupported(self) -> str | None:
        """None when the policy supports chunked prefill, else why not (`chunked_prefill_reason`)."""
        return type(self).chunked_prefill_reason

    @property
    def supports_chunked_prefill(self) -> bool:
        """Whether the engine may prefill a prompt in chunks under this policy, evicting after each
        chunk (`generate(..., prefill_chunk=N)`)."""
        return self.chunked_prefill_unsupported() is None

    def chunk_minimum(self) -> int:
        """The smallest prefill chunk this policy accepts: its observation window (the last `window`
        queries of every chunk score the cache), at least 1."""
        return max(1, self.requirements().observe.window)

    def for_prompts(self, fmt: PromptFormat | None) -> Policy:
        """The policy to run on a batch whose prompts are written as `fmt` (None: the engine knows no chat
        template for them: token ids, or a model without one). The engine calls it once per request,
        before planning; the default is the policy itself. Raises ValueError for a batch it cannot run."""
        return self

    def observation_inputs(self) -> Any:
        """The traced inputs (a pytree, or None) that the passes the policy's spec runs after the prefill
        (its producer observations) take: e.g. LookaheadKV's adapter params."""
        return None

    def plan(
        self,
        lengths: Sequence[int],
        num_layers: int,
        num_kv_heads: int,
        *,
        budget: int | None = None,
        compression_ratio: float | None = None,
        max_new_tokens: int = 0,
        bucket: int | None = None,
        question_tokens: int = 0,
    ) -> Plan:
        """Host-side plan for rows of `lengths` prompt tokens (`bucket`: their padded length).

        Exactly one of `budget` (entries kept per KV head, protected tokens included; the average
        over layers and heads for allocating policies) and `compression_ratio` (kvpress's fraction
        removed, n_kept = int(T * (1 - r)) per row) must be given. Raises ValueError/TypeError.
        max_new_tokens: every token appended after prefill (question tokens included).
        question_tokens: how many of those the engine appends without calling `decode_update`
          (context-then-question mode); decode-time capacities grow by that much, and the first
          `decode_update` evicts back to the budget.
        """
        req = PlanRequest.checked(
            lengths, num_layers, num_kv_heads, budget, compression_ratio, max_new_tokens, bucket, question_tokens
        )
        return self.build_plan(req)

    def build_plan(self, req: "PlanRequest") -> Plan:
        raise NotImplementedError

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, DecodeState | None]:
        """keep [L,B,Hkv,C] bool, and per-slot state ([L,B,Hkv,C] leaves, moved with the slots by
        the compaction) for `init_decode`, or None."""
        raise NotImplementedError

    def init_decode(self, plan: Plan, cache: KVCache, slot_state: DecodeState | None) -> DecodeState:
        """Decode state after compaction; prefill-only policies carry none."""
        return DecodeState()

    def decode_update(
        self, plan: Plan, state: DecodeState, cache: KVCache, step_probs: jax.Array, written: jax.Array, t: jax.Array
    ) -> tuple[DecodeState, jax.Array]:
        """Prefill-only policies never evict during decoding."""
        return state, cache.valid

    def decode_step(
        self, plan: Plan, state: Any, cache: KVCache, obs: Observations, written: jax.Array, t: jax.Array
    ) -> tuple[Any, jax.Array]:
        """What the engine calls after every decode step's attention: `decode_update` with the step's
        observations (`obs`, the decode phase of the policy's spec)."""
        return self.decode_update(plan, state, cache, obs.step_probs, written, t)


def compress_prefill(
    policy: Policy, plan: Plan, cache: KVCache, obs: Observations, *, capacity: int
) -> tuple[KVCache, DecodeState]:
    """The prefill eviction sequence on a full cache: the policy's keep mask, the compacted (or
    masked) cache, its per-slot state moved with the slots, and the policy's decode state.

    obs may hold more than the policy asked for (a prefill shared by several policies records the
    union): it is restricted to the policy's own window first. `capacity`: the least number of
    slots per head the returned cache must have when the plan does not compact it (decode room).
    """
    obs = obs.restrict(policy.requirements().observe)
    keep, slot_state = policy.prefill_keep(plan, cache, obs)
    if plan.compact:
        cache, src = cache.compact(keep, plan.capacity)
        if slot_state is not None:
            slot_state = jax.tree.map(lambda x: gather_slots(x, src), slot_state)
    else:
        cache = cache.evict(keep)
        if cache.capacity < capacity:
            cache, _ = cache.compact(cache.valid, capacity)
    return cache, policy.init_decode(plan, cache, slot_state)


# ----------------------------------------------------------------------------- validation


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_float(name: str, value: Any, lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite float, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if bad_lo or bad_hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value}")


def check_budget(budget: Any, compression_ratio: Any, policy: str | None = None) -> None:
    """The one check of the budget knob (the engine's settings, `Policy.plan` and the eval CLI):
    exactly one of `budget` (entries kept per KV head, an int >= 1) and `compression_ratio` (the
    fraction removed, 0 <= r < 1). ValueError / TypeError naming the argument and what it accepts."""
    if (budget is None) == (compression_ratio is None):
        got = "both" if budget is not None else "neither"
        who = f"policy {policy!r} needs " if policy else "pass "
        raise ValueError(f"{who}exactly one of budget= (entries kept per KV head, an int >= 1) or "
                         f"compression_ratio= (fraction removed, 0 <= r < 1); got {got}")
    if budget is not None:
        check_int("budget", budget if not hasattr(budget, "item") else budget.item(), 1)
    else:
        check_float("compression_ratio", compression_ratio, 0.0, 1.0, hi_open=True)


def check_pool_kernel(name: str, kernel: Any) -> None:
    check_int(name, kernel, 1)
    if kernel % 2 == 0:
        raise ValueError(f"{name} must be odd (same-padding pooling), got {kernel}")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """The validated arguments of `Policy.plan`."""

    lengths: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    budget: int | None
    ratio: float | None
    max_new_tokens: int
    bucket: int | None
    question_tokens: int = 0

    @classmethod
    def checked(
        cls,
        lengths: Sequence[int],
        num_layers: int,
        num_kv_heads: int,
        budget: Any,
        ratio: Any,
        max_new_tokens: int,
        bucket: int | None,
        question_tokens: int = 0,
    ) -> "PlanRequest":
        check_budget(budget, ratio)
        lengths = tuple(lengths)
        if not lengths:
            raise ValueError("lengths must name at least one row")
        for i, n in enumerate(lengths):
            check_int(f"lengths[{i}]", n, 1)
        check_int("num_layers", num_layers, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("max_new_tokens", max_new_tokens, 0)
        if bucket is not None:
            check_int("bucket", bucket, max(lengths))
        check_int("question_tokens", question_tokens, 0)
        if question_tokens > max_new_tokens:
            raise ValueError(f"question_tokens={question_tokens} must not exceed max_new_tokens={max_new_tokens}")
        return cls(lengths, num_layers, num_kv_heads, budget, ratio, max_new_tokens, bucket, question_tokens)

    def row_budgets(self, compat: str) -> tuple[int, ...]:
        """Per-row absolute budget: `budget` itself, or kvpress's n_kept for a ratio."""
        return row_budgets(self.lengths, self.budget, self.ratio, compat)

    def finish(
        self,
        counts: Sequence[Sequence[int]],
        *,
        capacity: int,
        evicts: bool,
        alloc: AllocData | None = None,
        decode_budget: Sequence[int] = (),
    ) -> Plan:
        """Builds the Plan. No head ever holds more than max(T) + max_new_tokens entries, so the
        capacity is capped there; the cache is compacted when prefill evicts or when that saves slots."""
        most = max(self.lengths) + self.max_new_tokens
        capacity = max(1, min(capacity, most))
        prefill_slots = (self.bucket if self.bucket is not None else max(self.lengths)) + self.max_new_tokens
        return Plan(
            lengths=self.lengths,
            counts=tuple(tuple(int(c) for c in row) for row in counts),
            alloc=alloc,
            decode_budget=tuple(int(c) for c in decode_budget),
            capacity=int(capacity),
            compact=bool(evicts or capacity < prefill_slots),
            max_new_tokens=self.max_new_tokens,
        )


# ----------------------------------------------------------------------------- budget arithmetic


def kvpress_n_kept(length: int, ratio: float, compat: str = "0.5.4") -> int:
    """kvpress's `int(T * (1 - r))`, in Python float64 and in that order (policies.md §1.1)."""
    n = int(length * (1 - ratio))
    if compat != "0.5.4":
        return max(1, n) if ratio < 1 else 0
    return n


def row_budgets(lengths: Sequence[int], budget: int | None, ratio: float | None, compat: str) -> tuple[int, ...]:
    """Per-row absolute budget: `budget` itself, or kvpress's n_kept for a ratio."""
    if budget is not None:
        return tuple(budget for _ in lengths)
    return tuple(kvpress_n_kept(t, ratio, compat) for t in lengths)


def shortest_prompt(protect: int, ratio: float, compat: str = "0.5.4") -> int:
    """The fewest prompt tokens T whose kvpress budget int(T * (1 - ratio)) exceeds `protect` (0 <= ratio < 1)."""
    n = max(protect + 1, int((protect + 1) / (1 - ratio)) - 2)
    while n > protect + 1 and kvpress_n_kept(n - 1, ratio, compat) > protect:
        n -= 1
    while kvpress_n_kept(n, ratio, compat) <= protect:
        n += 1
    return n


def check_protected(name: str, budgets: Sequence[int], lengths: Sequence[int], protect: int, *,
                    ratio: float | None, compat: str = "0.5.4") -> None:
    """Paper presets: a budget must exceed the protected tokens (policies.md §1.6). `ratio`: the
    compression_ratio the budgets come from (None: an absolute budget); `compat`: its kvpress rule."""
    for b, (c, t) in enumerate(zip(budgets, lengths)):
        if c > protect or (ratio is not None and c >= t):
            continue
        if ratio is None:
            raise ValueError(
                f"{name}: budget={c} must exceed the {protect} protected tokens (window/sinks); pass "
                f"budget > {protect}, or use the *_kvpress preset, which keeps the most recent protected tokens"
            )
        need = (f"at compression_ratio={ratio} a prompt needs at least {shortest_prompt(protect, ratio, compat)} "
                f"tokens (int(T*(1-r)) > {protect})")
        if t <= protect:  # nothing but protected tokens (kvpress presets: windows as long or longer)
            raise ValueError(
                f"{name}: row {b} has {t} tokens, not more than its {protect} protected tokens (window/sinks), so "
                f"this preset cannot compress it: {need}; pass longer prompts, or use a policy without protected "
                "tokens (e.g. knorm_kvpress)"
            )
        raise ValueError(
            f"{name}: row {b}: compression_ratio={ratio} leaves {c} of {t} tokens, which must exceed the {protect} "
            f"protected tokens (window/sinks): {need}; lower compression_ratio, pass longer prompts, or use the "
            "*_kvpress preset, which keeps the most recent protected tokens"
        )


# ----------------------------------------------------------------------------- selection


def _ordered_int(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same total order (IEEE's: -NaN < -inf < ... < -0 < +0 < ... < inf < NaN)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))


def _order_keys(
    scores: jax.Array, valid: jax.Array, pos: jax.Array, protected: jax.Array | None, tiebreak: jax.Array | None
) -> list[jax.Array]:
    """Sort keys of `rank`'s order. The first packs the group (protected, scored, invalid) with the score:
    int32 min for protected slots, max for invalid ones, the score's order in between (clipped off the two
    ends, which only the NaNs of the largest payloads reach)."""
    prot = valid & protected if protected is not None else jnp.zeros_like(valid)
    normal = valid & ~prot
    s = scores.astype(jnp.float32)
    s = jnp.where(s == 0, jnp.float32(0), s)  # -0.0 ties with +0.0
    lo, hi = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).max
    first = jnp.where(normal, jnp.clip(_ordered_int(-s), lo + 1, hi - 1), jnp.where(prot, lo, hi))
    keys = [first]
    if tiebreak is not None:
        keys.append(jnp.where(normal, -tiebreak, jnp.zeros_like(tiebreak)))
    pos = pos.astype(jnp.int32)
    keys.append(jnp.where(prot, -pos, pos))
    return keys


INVERSIONS = ("scatter", "sort")


def inverse_permutation(perm: jax.Array, by: str | None = None) -> jax.Array:
    """r with r[..., perm[..., i]] = i along the last axis. by="scatter" (on CPU ~50x cheaper than the sort)
    or "sort" (a second stable sort); None: the sort on TPUs, where scatters serialise, else the scatter."""
    if by is None:
        by = "sort" if jax.default_backend() == "tpu" else "scatter"
    check_choice("by", by, INVERSIONS)
    iota = jax.lax.broadcasted_iota(jnp.int32, perm.shape, perm.ndim - 1)
    if by == "sort":
        return jax.lax.sort((perm, iota), dimension=-1, is_stable=True, num_keys=1)[1]
    lead = tuple(jax.lax.broadcasted_iota(jnp.int32, perm.shape, d) for d in range(perm.ndim - 1))
    return jnp.zeros_like(perm).at[(*lead, perm)].set(iota, unique_indices=True)


def rank(
    scores: jax.Array,
    valid: jax.Array,
    *,
    pos: jax.Array,
    protected: jax.Array | None = None,
    tiebreak: jax.Array | None = None,
    invert_by: str | None = None,
) -> jax.Array:
    """Rank of every slot along the last axis (0 = kept first), int32, same shape as `scores`.

    Order: valid protected slots (most recent first), then valid slots by score descending,
    then `tiebreak` descending, then lower position first; invalid slots last. One stable sort
    and the inverse of its permutation (`inverse_permutation(perm, invert_by)`; ties beyond these keys go
    to the lower slot index).
    """
    keys = _order_keys(scores, valid, pos, protected, tiebreak)
    iota = jax.lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    perm = jax.lax.sort((*keys, iota), dimension=-1, is_stable=True, num_keys=len(keys))[-1]
    return inverse_permutation(perm, invert_by)


SELECTIONS = ("bisection", "sort")


def select(
    scores: jax.Array,
    valid: jax.Array,
    counts: jax.Array,
    *,
    pos: jax.Array,
    protected: jax.Array | None = None,
    tiebreak: jax.Array | None = None,
    by: str | None = None,
) -> jax.Array:
    """Keep mask: the `counts[...]` first valid slots of each row in `rank` order.

    scores, valid, pos, protected, tiebreak: [..., C]; counts: broadcastable to [...] (static or
    traced). Protected slots come first, so a count below the protected set keeps the most recent.
    by="bisection": `first_in_order`, no sort (on CPU ~10x cheaper); "sort": `rank` < counts. None:
    the bisection on CPUs; the sort on accelerators, where the bisection's 32 sequential reductions per
    key may cost more launches than one sort (not yet measured there: `python -m kvjax.bench select`).
    """
    if by is None:
        by = "bisection" if jax.default_backend() == "cpu" else "sort"
    check_choice("by", by, SELECTIONS)
    counts = jnp.broadcast_to(jnp.asarray(counts, jnp.int32), scores.shape[:-1])
    if by == "sort":
        return valid & (rank(scores, valid, pos=pos, protected=protected, tiebreak=tiebreak) < counts[..., None])
    keys = [_int_key(k) for k in _order_keys(scores, valid, pos, protected, tiebreak)]
    return valid & first_in_order(keys, counts)


def _int_key(x: jax.Array) -> jax.Array:
    """An int32 key with the order `lax.sort` gives `x` (floats: -0.0 equal to +0.0, every NaN equal and last)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jnp.where(x == 0, jnp.zeros_like(x), x)
        return _ordered_int(jnp.where(jnp.isnan(x), jnp.full_like(x, jnp.nan), x))
    return x.astype(jnp.int32)


def first_in_order(keys: Sequence[jax.Array], counts: jax.Array) -> jax.Array:
    """Mask of the `counts [...]` first slots of each row in the lexicographic order of the int32 `keys`
    ([..., C] each; ties beyond them go to the lower slot): what `rank(...) < counts` gives, without a sort.

    Key by key, 32 bisection steps find the smallest t such that `need` slots of the tied set have
    key <= t; those below t are in, those at t stay tied for the next key, and the last ties go by
    slot. O(32 C) per key and row, a reduction per step: on CPU ~10x cheaper than the sort and its inverse.
    """
    tied = jnp.ones(keys[0].shape, jnp.bool_)
    kept = jnp.zeros(keys[0].shape, jnp.bool_)
    need = counts
    for key in keys:
        t = _bisect(key, tied, need)[..., None]
        below = tied & (key < t)
        kept, need, tied = kept | below, need - below.sum(-1, dtype=jnp.int32), tied & (key == t)
    return kept | (tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= need[..., None]))


def _bisect(key: jax.Array, among: jax.Array, need: jax.Array) -> jax.Array:
    """Per row [...]: the smallest int32 t with #(among & key <= t) >= need (int32 max when none is)."""
    info = jnp.iinfo(jnp.int32)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        enough = jnp.sum(among & (key <= mid[..., None]), axis=-1, dtype=jnp.int32) >= need
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    # [min, max] holds 2**32 values: 32 halvings leave one, with no step past max
    start = (jnp.full(need.shape, info.min, jnp.int32), jnp.full(need.shape, info.max, jnp.int32))
    return jax.lax.fori_loop(0, 32, step, start)[1]


def recent_mask(pos: jax.Array, valid: jax.Array, n: jax.Array | int) -> jax.Array:
    """The `n` valid slots with the largest positions, per row of the last axis."""
    return select(pos.astype(jnp.float32), valid, n, pos=pos)


def window_protected(pos: jax.Array, valid: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
    """Prefill protection of the last `window` real tokens of each row: pos >= len_b - window.

    pos, valid: [L, B, Hkv, C]; lengths: [B].
    """
    return valid & (pos >= (lengths - window)[None, :, None, None])
