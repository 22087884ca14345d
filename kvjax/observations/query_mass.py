"""Query mass (LookaheadKV's training targets and its lookahead pass): per query head and cache slot,
the attention probability summed over the call's real queries.

Field: query_mass [L,B,Hq,C] float32 (a prefill's padded to the capacity; a chunk's cut to the
cache slots, leaving out its own keys when they are not stored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import CallView, LayerView, Observation
from kvjax.observations.column_mass import pad_slots


@dataclasses.dataclass(frozen=True)
class QueryMass(Observation):
    keyword = "query_mass"
    fields = ("query_mass",)

    def needs(self, call: CallView) -> frozenset[str]:
        return frozenset({"probs"})

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        call = view.call
        B, Hq = view.q.shape[:2]
        real = (call.positions >= 0)[:, None, None, :, None]
        mass = jnp.sum(jnp.where(real, attn.probs, 0.0), axis=3).reshape(B, Hq, -1)
        return {"query_mass": pad_slots(mass, call) if call.fresh else mass[:, :, :call.capacity]}
