"""Window queries (SnapKV family, CAKE, the window scorers): the post-RoPE queries of the last `size`
real tokens of each row.

Fields: window_queries [L,B,Hq,w,D] (model dtype); window_positions [B,w] int32, their absolute
positions (-1 where a row has fewer than w tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.observations.base import CallView, LayerView, Observation


def _index(call: CallView, size: int) -> jax.Array:
    """[B,w]: the index in the call of each row's last `size` real tokens (negative before the first)."""
    return call.lengths[:, None] - size + jnp.arange(size)


@dataclasses.dataclass(frozen=True)
class WindowQueries(Observation):
    size: int

    keyword = "window"
    fields = ("window_queries", "window_positions")

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"window must be a positive int (queries recorded), got {self.size!r}")

    @classmethod
    def from_keyword(cls, value: Any) -> WindowQueries | None:
        return cls(int(value)) if value else None

    @classmethod
    def absent(cls) -> int:
        return 0

    def value(self) -> int:
        return self.size

    def merge(self, other: Observation) -> WindowQueries:
        return WindowQueries(max(self.size, other.size))

    def restrict(self, values: dict[str, Any]) -> dict[str, Any]:
        q, p = values.get("window_queries"), values.get("window_positions")
        if q is None:
            return {}
        held = q.shape[3]
        if self.size > held:
            raise ValueError(f"observations hold a window of {held} queries; {self.size} were asked for")
        return {"window_queries": q[:, :, :, held - self.size:], "window_positions": p[:, p.shape[1] - self.size:]}

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        index = jnp.maximum(_index(view.call, self.size), 0)
        return {"window_queries": jnp.take_along_axis(view.q, index[:, None, :, None], axis=2)}

    def per_call(self, call: CallView) -> dict[str, Any]:
        index = _index(call, self.size)
        absolute = jnp.take_along_axis(call.positions, jnp.maximum(index, 0), axis=1)
        return {"window_positions": jnp.where((index >= 0) & (absolute >= 0), absolute, -1)}
