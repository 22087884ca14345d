"""Prefill-time eviction: a scorer composed with a budget allocator, then `select`."""

from __future__ import annotations

import dataclasses
import jax

from kvjax.cache import KVCache
from kvjax.observations import Observations
from kvjax.policies.allocators import RULES, Allocation, Allocator, Uniform
from kvjax.policies.base import (
    DecodeState,
    Plan,
    PlanRequest,
    Policy,
    Requirements,
    check_choice,
    check_protected,
    select,
)
from kvjax.policies.scoring import Scored


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillPolicy(Policy):
    """Scores the prompt once after prefill and keeps per-head counts from the allocator.

    rule="paper": a budget must exceed the protected tokens (ValueError otherwise).
    rule="kvpress": kvpress semantics (a budget below the protected set keeps the most recent).
    Subclasses define `score` (and `protected_count`, `scorer_requirements`).
    """

    allocator: Allocator = Uniform()
    rule: str = "paper"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("rule", self.rule, RULES)
        alloc = self.budget_allocator()
        if not isinstance(alloc, Allocator):
            raise TypeError(f"allocator must be an Allocator (Uniform, Pyramid, Ada, Cake), got {alloc!r}")

    # -- what a scorer defines
    def protected_count(self) -> int:
        """Protected prompt tokens per row (window, sinks); counted inside the budget."""
        return 0

    def scorer_requirements(self) -> Requirements:
        return Requirements()

    def score(self, plan: Plan, cache: KVCache, obs: Observations) -> Scored:
        raise NotImplementedError

    def check_lengths(self, lengths: tuple[int, ...]) -> None:
        """Per-policy limits on prompt lengths (kvpress asserts T > window, ...)."""

    # -- the pipeline
    def budget_allocator(self) -> Allocator:
        return self.allocator

    def chunked_prefill_unsupported(self) -> str | None:
        reason = super().chunked_prefill_unsupported()
        alloc = self.budget_allocator()
        if reason is None and getattr(alloc, "cascade", False):
            return "the cascade allocator re-evicts earlier layers during one whole-prompt pass"
        return reason

    def chunk_minimum(self) -> int:
        """The observation window and the protected tokens (window, sinks) must fit in one chunk."""
        return max(super().chunk_minimum(), self.protected_count())

    def requirements(self) -> Requirements:
        return self.scorer_requirements().merge(self.budget_allocator().requirements())

    def allocate(self, req: PlanRequest) -> Allocation:
        protect = self.protected_count()
        if self.rule == "paper":
            budgets = req.row_budgets(self.kvpress_compat)
            check_protected(type(self).__name__, budgets, req.lengths, protect, ratio=req.ratio,
                            compat=self.kvpress_compat)
        return self.budget_allocator().allocate(req, protect=protect, compat=self.kvpress_compat)

    def build_plan(self, req: PlanRequest) -> Plan:
        self.check_lengths(req.lengths)
        return self.finish_plan(req, self.allocate(req))

    def finish_plan(self, req: PlanRequest, alloc: Allocation) -> Plan:
        """Prefill-only: room for the largest kept set plus every new token."""
        kept = max(max(row) for row in alloc.bound)
        return req.finish(alloc.counts, alloc=alloc.data, capacity=kept + req.max_new_tokens, evicts=alloc.evicts)

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations) -> jax.Array:
        """Kept entries per (layer, row, head) [L,B,Hkv] int32, protected tokens included."""
        return self.budget_allocator().head_counts(plan, scored, cache, obs, self.protected_count())

    def prefill_keep(self, plan: Plan, cache: KVCache, obs: Observations) -> tuple[jax.Array, DecodeState | None]:
        """keep [L,B,Hkv,C] bool: per head the protected slots, then the best-scored ones."""
        scored = self.score(plan, cache, obs)
        counts = self.head_counts(plan, scored, cache, obs)
        keep = select(scored.scores, cache.valid, counts, pos=cache.pos, protected=scored.protected)
        return keep, None
