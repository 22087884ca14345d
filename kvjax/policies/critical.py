"""CriticalKV / CriticalAdaKV: two-stage selection weighted by each entry's projected value (arXiv 2502.03805).

A wrapper over any prefill scorer, like kvpress's CriticalKVPress(press) / CriticalAdaKVPress(press):
per (layer, row, KV head) with n kept entries (the scorer's allocator decides n, so Ada-KV's head
budgets make it CriticalAdaKV),
  stage 1 keeps the protected slots and the top int(n * first_stage_ratio) by the scorer's score s;
  stage 2 fills the rest of n by (s + epsilon) * ||v_j W_o||_1, the L1 norm of the value projected
    by the output projection of its query head (group mean).
The projected norm comes from the prefill as the `output_norms` observation (the model computes
v_j W_o^h once per prompt key in `extend`), so the policy never reads model weights; it is exact
(an L1 norm of a product does not factor into value norm times weight norm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.allocators import Allocator
from kvjax.policies.base import Plan, PlanRequest, Requirements, check_float, select
from kvjax.policies.prefill import PrefillPolicy
from kvjax.policies.scoring import Scored
from kvjax.policies.snapkv import SnapKV


NORM_FIELDS = {1: "output_norms", 2: "output_norms_l2", "rms": "output_norms_rms"}  # by `output_norms`' ord
GROUP_NORMS = ("mean", "rms")


def require_output_norms(obs: Observations, who: str, ord: int | str = 1) -> jax.Array:
    field = NORM_FIELDS[ord]
    if getattr(obs, field) is None:
        raise ValueError(f"{who} needs the `{field}` observation (ObservationSpec({field}=True))")
    return getattr(obs, field).astype(jnp.float32)


def two_stage_keep(
    scored: Scored, counts: jax.Array, norms: jax.Array, cache: KVCache, *, epsilon: float, first_stage_ratio: float
) -> jax.Array:
    """CriticalKV's selection. scored.scores/protected, norms: [L,B,Hkv,C]; counts [L,B,Hkv] (protected
    included). Returns the keep mask [L,B,Hkv,C] with exactly min(count, valid) entries per head."""
    valid, pos = cache.valid, cache.pos
    prot = scored.protected & valid
    first = jnp.floor(counts.astype(jnp.float32) * jnp.float32(first_stage_ratio)).astype(jnp.int32)
    stage1 = select(scored.scores, valid, first, pos=pos, protected=prot)
    weighted = (scored.scores.astype(jnp.float32) + jnp.float32(epsilon)) * norms
    return select(weighted, valid, counts, pos=pos, protected=prot | stage1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticalKV(PrefillPolicy):
    """CriticalKV over `scorer` (a prefill policy: its score, protected tokens, budget rule and
    allocator are used as they are). kvpress defaults: epsilon=1e-4, first_stage_ratio=0.5.

    Stage 1 keeps int(n * first_stage_ratio) entries (kvpress: int((1-r) T first_stage_ratio);
    identical for the default 0.5); protected slots always count in stage 1, as kvpress's max+1
    scores make them. value_norm: 1, the paper's ||v_j W_o||_1; 2, the L2 norm ||v_j W_o||_2, which the
    prefill gets from W_o's D x D Gram matrices at D / E of the L1 norm's cost (E the model width).
    group_norm: how the G query heads sharing a KV head combine their norms: "mean" (kvpress's group mean), or
    with value_norm=2 "rms", sqrt(mean_h ||v_j W_o^h||_2^2), from one Gram matrix summed over the group (a G-th
    of the L2 group mean's cost; it weighs a value by its whole contribution to the group's heads).
    The wrapper's `rule` and `kvpress_compat` are set on the scorer (pass rule="kvpress" for a kvpress
    scorer); `allocator` of the wrapper is unused (the scorer's applies).
    """

    name = "critical_snapkv"  # the preset equal to the class defaults (scorer=SnapKV())
    chunked_prefill_reason = "its output-norm weights (v W_o per key) are recorded by the one-shot prefill only"

    scorer: PrefillPolicy = SnapKV()
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    value_norm: int = 1
    group_norm: str = "mean"

    def __post_init__(self) -> None:
        if not isinstance(self.scorer, PrefillPolicy) or isinstance(self.scorer, CriticalKV):
            raise TypeError(f"scorer must be a prefill policy (SnapKV, AdaSnapKV, KNorm, ...), got {self.scorer!r}")
        super().__post_init__()
        if self.scorer.decode_time:
            raise ValueError(f"scorer must be prefill-only; {type(self.scorer).__name__} evicts while decoding "
                             "(pass decode=False)")
        # the wrapper's budget rule and kvpress arithmetic are the scorer's (its plan applies)
        if (self.scorer.rule, self.scorer.kvpress_compat) != (self.rule, self.kvpress_compat):
            scorer = dataclasses.replace(self.scorer, rule=self.rule, kvpress_compat=self.kvpress_compat)
            object.__setattr__(self, "scorer", scorer)
        check_float("epsilon", self.epsilon, 0.0, float("inf"), hi_open=True)
        check_float("first_stage_ratio", self.first_stage_ratio, 0.0, 1.0)
        if isinstance(self.value_norm, bool) or self.value_norm not in (1, 2):
            raise ValueError(f"value_norm must be 1 (||v W_o||_1) or 2 (||v W_o||_2), got {self.value_norm!r}")
        if self.group_norm not in GROUP_NORMS:
            raise ValueError(f"group_norm must be one of {GROUP_NORMS}, got {self.group_norm!r}")
        if self.group_norm == "rms" and self.value_norm != 2:
            raise ValueError("group_norm='rms' needs value_norm=2 (the group's squared L2 norms share one Gram "
                             f"matrix), got value_norm={self.value_norm!r}")

    @property
    def norm_ord(self) -> int | str:
        """The `output_norms` ord this wrapper reads: 1, 2, or "rms"."""
        return "rms" if self.group_norm == "rms" else self.value_norm

    def budget_allocator(self) -> Allocator:
        return self.scorer.budget_allocator()

    def protected_count(self) -> int:
        return self.scorer.protected_count()

    def requirements(self) -> Requirements:
        norms = ObservationSpec(**{NORM_FIELDS[self.norm_ord]: True})
        return self.scorer.requirements().merge(Requirements(observe=norms))

    def observation_inputs(self) -> Any:
        """The scorer's (e.g. LookaheadKV's adapter params, for its tokens' pass)."""
        return self.scorer.observation_inputs()

    def build_plan(self, req: PlanRequest) -> Plan:
        return self.scorer.build_plan(req)

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        return self.scorer.score(plan, cache, obs)

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations) -> jax.Array:
        return self.scorer.head_counts(plan, scored, cache, obs)

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, None]:
        scored = self.score(plan, cache, obs)
        counts = self.head_counts(plan, scored, cache, obs)
        norms = require_output_norms(obs, "CriticalKV", self.norm_ord)
        keep = two_stage_keep(scored, counts, norms, cache, epsilon=self.epsilon,
                              first_stage_ratio=self.first_stage_ratio)
        return keep, None
