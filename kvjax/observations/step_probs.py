"""Step probabilities (decode-time eviction: H2O, TOVA, CAKE, LazyEviction): the attention
probabilities of the call's last query over the cache slots, recorded in decode steps only.

Field: step_probs [L,B,Hkv,G,C] float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.observations.base import CallView, LayerView, Observation


@dataclasses.dataclass(frozen=True)
class StepProbs(Observation):
    keyword = "step_probs"
    fields = ("step_probs",)
    phases = frozenset({"decode"})

    def needs(self, call: CallView) -> frozenset[str]:
        return frozenset() if call.fresh else frozenset({"probs"})

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        return {} if view.call.fresh else {"step_probs": attn.probs[:, :, :, -1, :]}
