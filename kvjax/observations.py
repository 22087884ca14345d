"""What prefill hands to a policy (see DESIGN.md, "Observations a policy may ask for")."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class Observations:
    """window_queries [L,B,Hq,w,D]: post-RoPE queries of the last w real prompt tokens of each row;
    window_positions [B,w] int32: their absolute positions;
    column_mass [L,B,Hkv,C] float32: attention mass that all causal prompt queries put on each slot
      (summed over the query group);
    lengths [B] int32: real prompt lengths. Absent observations are None."""

    window_queries: jax.Array | None = None
    window_positions: jax.Array | None = None
    column_mass: jax.Array | None = None
    lengths: jax.Array | None = None
