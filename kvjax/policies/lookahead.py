"""LookaheadKV (policies.md §11.3): prompt keys scored by the attention of learned lookahead tokens.

The engine runs the adapter's n tokens after the prompt (LoRA on their rows, never stored in the
cache: the `LookaheadTokens` observation, with the adapter params as this policy's
`observation_inputs`) and hands over their attention mass per query head, `Observations.query_mass`
[L,B,Hq,C];
this policy turns it into scores: s̃ = mass / n (plus window_weight x the mean attention of the prompt's own
last `window` queries, when the adapter's config sets a window: SnapKV's observation, in the query-aware
protocol the question), reduced over the query group (mean or max), valleys
between attended slots bridged (or not), max-pooled along positions (or not), and each slot raised to
tail_weight x the highest score of the `tail` slots before it (or not), exactly as configured in the
adapter's `LookaheadConfig`.

Any allocator composes (the `ada_lookahead_kv`, `layer_lookahead_kv`, `cake_lookahead_kv` presets), and
CriticalKV wraps it (`critical_lookahead_kv`; over Ada-KV's head budgets, CriticalAdaKV's reading,
`critical_ada_lookahead_kv`). With `Cake(preference="scorer")` CAKE's layer
preference is measured on the lookahead tokens' attention: the pass also records the second moment and
the entropy terms of the n tokens' probabilities (`query_sumsq`, `query_entropy`), and per (layer, row)
  H_l = -sum_{h,i,j} A[h,i,j] log(A[h,i,j] + 1e-10),  V_l = sum_{h,j} Var_i A[h,i,j] (unbiased, over n),
over the query heads h, the n tokens i and the candidate prompt slots j (all but the protected
last), then log P_l = log H_l / tau1 + log V_l / tau2 as in CAKE (policies.md §8).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.lookahead import Adapter, LookaheadConfig, load
from kvjax.observations import Observations, ObservationSpec
from kvjax.passes.lookahead import LookaheadTokens
from kvjax.policies.allocators import Ada, Allocator, Cake, Global, cake_log_preference
from kvjax.policies.base import Plan, Policy, Requirements, as_i32, window_protected
from kvjax.policies.critical import CriticalKV
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import (Scored, attention_scale, bridge1d, group_reduce_fn, last_window, pool1d, trail1d,
                                    window_moments)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Adapter:
    return load(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LookaheadKV(PrefillPolicy):
    """LookaheadKV with a trained adapter; uniform budget by default (any allocator composes).

    adapter: an `Adapter` (kvjax.lookahead.load / init_adapter; an ensemble from kvjax.lookahead.stack,
      scored by the mean of its members' lookahead attention), a folder to load one from, or None
      for the bundled model's adapter (kvjax/assets/lookahead). Loaded when first needed; a missing
      bundled adapter raises FileNotFoundError saying how to pass one.
    Query-aware by default (the paper); `query_aware=False` scores the context alone in the eval's
    context-then-question mode. Scoring options (gqa_reduce, bridge, pooling, kernel, pool_offset,
    tail, tail_weight, protect_last, window, window_weight) are
    the adapter's `LookaheadConfig`.
    """

    name = "lookahead_kv"
    chunked_prefill_reason = ("its learned tokens are trained to follow the whole prompt and run once, "
                              "after it")

    adapter: Any = dataclasses.field(default=None, compare=False)
    # what the compiled scoring depends on: the adapter's config (or its path, until loaded)
    _identity: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        a = self.adapter
        if a is None:
            ident: Any = ("bundled",)
        elif isinstance(a, (str, os.PathLike)):
            ident = ("path", os.fspath(a))
        elif isinstance(a, Adapter):
            ident = ("adapter", a.config, a.model_info, a.members)
        else:
            raise TypeError("adapter must be a kvjax.lookahead.Adapter, a folder path, or None (the bundled "
                            f"model's adapter), got {type(a).__name__}")
        object.__setattr__(self, "_identity", ident)

    def lookahead_adapter(self) -> Adapter:
        """The adapter (loaded from its folder, or the bundled one, on first use)."""
        a = self.adapter
        if isinstance(a, Adapter):
            return a
        return _load("bundled" if a is None else os.fspath(a))

    @property
    def config(self) -> LookaheadConfig:
        return self.lookahead_adapter().config

    def protected_count(self) -> int:
        return self.config.protected

    @property
    def decode_time(self) -> bool:
        """Whether the policy evicts during decoding: never (answered without loading the adapter)."""
        return self.budget_allocator().requirements().decode_eviction

    def cake_preference(self) -> Cake | None:
        """The Cake allocator whose layer preference these scores supply (preference="scorer"), or None."""
        alloc = self.budget_allocator()
        return alloc if isinstance(alloc, Cake) and alloc.preference == "scorer" else None

    def scorer_requirements(self) -> Requirements:
        a = self.lookahead_adapter()
        tokens = LookaheadTokens(a.config, a.model_info, moments=self.cake_preference() is not None, members=a.members)
        return Requirements(observe=ObservationSpec(tokens, window=a.config.window))

    def observation_inputs(self) -> dict[str, Any]:
        """The adapter params the lookahead pass runs with."""
        return self.lookahead_adapter().params

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        conf = self.config
        if obs.query_mass is None:
            raise ValueError("LookaheadKV needs the lookahead pass's query_mass observation (the engine's "
                             "LookaheadTokens pass, which its requirements ask for)")
        L, B, Hq, C = obs.query_mass.shape
        Hkv = cache.k.shape[2]
        s = (obs.query_mass / conf.n_tokens).reshape(L, B, Hkv, Hq // Hkv, C)
        if conf.window:  # the prompt's own last queries too: their mean attention per query head
            q, qpos = last_window(obs, conf.window)
            scale = attention_scale(obs, cache.k.shape[-1], True)
            win = window_moments(q, qpos, cache, scale=scale, group_reduce=None, moments=("sum",))["sum"]
            s = s + (conf.window_weight / conf.window) * win
        s = group_reduce_fn(s, conf.gqa_reduce, axis=3)
        lengths = as_i32(plan.lengths)
        w = conf.protected
        cand = cache.valid & (cache.pos < (lengths - w)[None, :, None, None])
        raw = s
        s = bridge1d(s, cand, conf.bridge)
        s = pool1d(s, cand, conf.kernel, "none" if conf.pooling is None else conf.pooling, conf.pool_offset)
        if conf.tail:
            s = jnp.maximum(s, conf.tail_weight * trail1d(raw, cand, conf.tail))
        s = jnp.where(cand, s, 0.0)
        protected = window_protected(cache.pos, cache.valid, lengths, w) if w else jnp.zeros_like(cache.valid)
        log_pref = None
        if (cake := self.cake_preference()) is not None:
            ent, var = lookahead_layer_statistics(obs, cand, conf.n_tokens)
            log_pref = cake_log_preference(ent, var, cake.tau1, cake.tau2)
        return Scored(s, protected, layer_log_pref=log_pref)


# ----------------------------------------------------------------------------- compositions (issue 27)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaLookaheadKV(LookaheadKV):
    """LookaheadKV scores with Ada-KV's head-wise allocation (alpha = 0.2, as ada_snapkv): each layer's
    Hkv * C entries go to the global top lookahead scores across its KV heads, cap_h = round(count_h * 0.8
    + int(0.2 C)) per head (policies.md §7, rule "paper"; C the budget minus the protected slots). The scores
    are means over the n tokens, so heads compare as Ada-SnapKV's window means do."""

    name = "ada_lookahead_kv"

    allocator: Allocator = Ada(alpha=0.2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerLookaheadKV(LookaheadKV):
    """LookaheadKV scores with Layer-DefensiveKV's global budget (`Global(across_layers=True)`, as
    layer_defensivekv): each row keeps Hkv * L * C entries (int(T (1 - r) Hkv L) for a ratio), the best
    lookahead scores over every layer and KV head (ties to the lower position, then layer, then head).
    There is no floor: with no protected tokens (`protect_last` = 0) a head whose tokens' attention on the
    prompt is weak may keep no prompt entry (its decode steps attend to the new tokens only), where
    layer_defensivekv always keeps its window."""

    name = "layer_lookahead_kv"

    allocator: Allocator = Global(across_layers=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CakeLookaheadKV(LookaheadKV):
    """LookaheadKV scores with CAKE's layer budgets (policies.md §8), the layer preference measured on
    the lookahead tokens' attention instead of the prompt's last window (`Cake(preference="scorer")`,
    tau1 = tau2 = 1): P_l = H_l^(1/tau1) V_l^(1/tau2), H_l the entropy and V_l the summed unbiased
    variance over the n tokens of their attention on the candidate prompt slots; (C - w) * L split by
    P_l, fixed up as cakekv's adjust_budgets, each layer capped at min(T - w, 2 (C - w)) (w =
    `protect_last`, 0 by default); every head of a layer keeps its top b_l lookahead scores. Prefill only
    (CAKE's decode-time eviction is CAKE's, not its allocator's). `LookaheadKV(allocator=Cake())` is the
    other reading, the preference from the prompt's last 32 queries."""

    name = "cake_lookahead_kv"

    allocator: Allocator = Cake(preference="scorer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticalLookaheadKV(CriticalKV):
    """CriticalKV's value-aware two-stage selection over LookaheadKV scores: per head of n kept entries,
    the top int(n / 2) by the lookahead score s, then the rest by (s + 1e-4) * ||v_j W_o||_1 (group mean of
    the projected value's L1 norm, the `output_norms` observation). n is the scorer's allocation: uniform for
    `LookaheadKV()` (`critical_lookahead_kv`), Ada-KV's head budgets for `scorer=AdaLookaheadKV()`
    (`critical_ada_lookahead_kv`, CriticalAdaKV). `adapter` (None: the scorer's own, the bundled one by
    default) is handed to the LookaheadKV scorer."""

    name = "critical_lookahead_kv"

    scorer: PrefillPolicy = LookaheadKV()
    adapter: Any = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.adapter is not None:
            object.__setattr__(self, "scorer", with_adapter(self.scorer, self.adapter))
        super().__post_init__()


def lookahead_layer_statistics(obs: Observations, cand: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """CAKE's (entropy H [L,B], variance V [L,B]) of the n lookahead tokens' attention over the
    candidate slots cand [L,B,Hkv,C], summed over every query head (see the module docstring)."""
    if obs.query_sumsq is None or obs.query_entropy is None:
        raise ValueError("CAKE's layer preference from the lookahead tokens needs their query moments "
                         "(LookaheadTokens(..., moments=True), which the policy's requirements ask for)")
    L, B, Hq, C = obs.query_mass.shape
    Hkv = cand.shape[2]
    split = lambda x: x.astype(jnp.float32).reshape(L, B, Hkv, Hq // Hkv, C)  # noqa: E731
    mass, sumsq, ent = split(obs.query_mass), split(obs.query_sumsq), split(obs.query_entropy)
    var = jnp.maximum((sumsq - mass * mass / n) / max(n - 1, 1), 0.0)
    c = cand[:, :, :, None, :]
    return jnp.where(c, ent, 0.0).sum((2, 3, 4)), jnp.where(c, var, 0.0).sum((2, 3, 4))


def lookahead_scorer(policy: Policy) -> LookaheadKV | None:
    """The LookaheadKV a policy scores with: itself, or the scorer of a wrapper (CriticalKV); else None."""
    if isinstance(policy, LookaheadKV):
        return policy
    inner = getattr(policy, "scorer", None)
    return lookahead_scorer(inner) if isinstance(inner, Policy) else None


def with_adapter(policy: Policy, adapter: Any) -> Policy:
    """`policy` scoring with `adapter` (an Adapter, a folder, or None for the bundled one): LookaheadKV's
    own field, or its wrapper's scorer's. TypeError for a policy that runs no lookahead tokens."""
    if isinstance(policy, LookaheadKV):
        return dataclasses.replace(policy, adapter=adapter)
    if lookahead_scorer(policy) is None:
        raise TypeError(f"{type(policy).__name__} runs no LookaheadKV tokens; only LookaheadKV and the policies "
                        "that wrap it take an adapter")
    return dataclasses.replace(policy, scorer=with_adapter(policy.scorer, adapter))
