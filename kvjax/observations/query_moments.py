"""Query moments (CAKE's layer preference measured on LookaheadKV's tokens): per query head and cache
slot, the second moment and the entropy terms of the attention probabilities over the call's real queries.

Fields (beside `query_mass`, their first moment), both [L,B,Hq,C] float32, shaped as `query_mass` (a
prefill's padded to the capacity; a chunk's cut to the cache slots):
  query_sumsq    sum_i A[i, j]^2;
  query_entropy  -sum_i A[i, j] log(A[i, j] + 1e-10) (CAKE's entropy term, before its sum over slots).
With n queries, the unbiased variance over them of slot j is (sumsq - mass^2 / n) / (n - 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import CallView, LayerView, Observation
from kvjax.observations.column_mass import pad_slots

ENTROPY_EPS = 1e-10  # inside the log, as cakekv


@dataclasses.dataclass(frozen=True)
class QueryMoments(Observation):
    keyword = "query_moments"
    fields = ("query_sumsq", "query_entropy")

    def needs(self, call: CallView) -> frozenset[str]:
        return frozenset({"probs"})

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        call = view.call
        B, Hq = view.q.shape[:2]
        real = (call.positions >= 0)[:, None, None, :, None]
        p = jnp.where(real, attn.probs.astype(jnp.float32), 0.0)
        sumsq = jnp.sum(p * p, axis=3).reshape(B, Hq, -1)
        ent = -jnp.sum(p * jnp.log(p + ENTROPY_EPS), axis=3).reshape(B, Hq, -1)
        if call.fresh:
            return {"query_sumsq": pad_slots(sumsq, call), "query_entropy": pad_slots(ent, call)}
        return {"query_sumsq": sumsq[:, :, :call.capacity], "query_entropy": ent[:, :, :call.capacity]}
