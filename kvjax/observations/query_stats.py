"""Query statistics (ExpectedAttention): the mean and covariance of a prefill's pre-RoPE queries at
the real positions >= `start`, with the model's RoPE frequencies, so that a policy can rotate them to
future positions without calling the model.

Fields: query_mean [L,B,Hq,D], query_cov [L,B,Hq,D,D] float32 (biased, 1/n; zeros for a row with no
such query); static rope_inv_freq: the inverse frequencies [D/2] (a tuple). Prefills only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import CallView, LayerView, Observation


def query_statistics(q: jax.Array, positions: jax.Array, start: int) -> tuple[jax.Array, jax.Array]:
    """Mean [B,Hq,D] and biased covariance [B,Hq,D,D] (float32) of the queries q [B,Hq,n,D] at the
    real positions >= start (positions [B,n], -1 = padding)."""
    sel = ((positions >= start) & (positions >= 0)).astype(jnp.float32)  # [B,n]
    count = jnp.maximum(sel.sum(-1), 1.0)[:, None, None]
    qf = q.astype(jnp.float32)
    mean = jnp.einsum("bhnd,bn->bhd", qf, sel) / count
    centered = (qf - mean[:, :, None, :]) * sel[:, None, :, None]
    cov = jnp.einsum("bhnd,bhne->bhde", centered, centered) / count[..., None]
    return mean, cov


@dataclasses.dataclass(frozen=True)
class QueryStats(Observation):
    start: int

    keyword = "query_stats"
    fields = ("query_mean", "query_cov")
    static_fields = ("rope_inv_freq",)

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"query_stats must be a position >= 0 (-1 = none), got {self.start!r}")

    @classmethod
    def from_keyword(cls, value: Any) -> QueryStats | None:
        return None if value is None or value < 0 else cls(int(value))

    @classmethod
    def absent(cls) -> int:
        return -1

    def value(self) -> int:
        return self.start

    def merge(self, other: Observation) -> QueryStats:
        if other != self:
            raise ValueError(f"query_stats: one prefill records query statistics from one position only, got "
                             f"{self.start} and {other.start} (run these policies in separate calls)")
        return self

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        if not view.call.fresh:
            return {}
        mean, cov = query_statistics(view.q_raw, view.call.positions, self.start)
        return {"query_mean": mean, "query_cov": cov}

    def per_call(self, call: CallView) -> dict[str, Any]:
        return {"rope_inv_freq": call.rope_inv_freq}
