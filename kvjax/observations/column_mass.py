"""Column mass (H2O, observed attention): per key, the attention mass every valid, causal query of
the call puts on it, summed over the query group.

Field: column_mass [L,B,Hkv,C] float32 (zero past a prefill's tokens). Attention provides it: from a
prefill's log-sum-exp by the two-pass kernel, from the probabilities when they exist, or summed in
query blocks (`kvjax.kernels.attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import CallView, LayerView, Observation


def pad_slots(x: jax.Array, call: CallView) -> jax.Array:
    """A prefill's per-key array [..., n] padded with zeros to the cache's capacity [..., C]."""
    if not call.fresh:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, call.capacity - x.shape[-1])])


@dataclasses.dataclass(frozen=True)
class ColumnMass(Observation):
    keyword = "column_mass"
    fields = ("column_mass",)

    def needs(self, call: CallView) -> frozenset[str]:
        return frozenset({"column_mass"})

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        return {"column_mass": pad_slots(attn.column_mass, view.call)}

    def chunk_init(self, valid: jax.Array) -> jax.Array:
        return jnp.zeros(valid.shape, jnp.float32)

    def chunk_accumulate(self, values: dict[str, Any], carried: jax.Array, valid: jax.Array
                         ) -> tuple[dict[str, Any], jax.Array]:
        """The mass every query fed so far put on each surviving slot (H2O's accumulated attention)."""
        mass = jnp.where(valid, carried + values["column_mass"].astype(jnp.float32), 0.0)
        return {**values, "column_mass": mass}, mass
