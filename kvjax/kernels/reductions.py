"""Score reductions shared by the kernels, their references and the policies.

Per-key moments of attention probabilities (what one query's probability ``p`` adds to a key's
score) and reductions over the G query heads of a KV group (GQA).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

GROUP_REDUCTIONS = ("mean", "sum", "max", None)
MOMENTS = ("sum", "sumsq", "entropy")
ENTROPY_EPS = 1e-10


def moment_contribution(moment: str, p: jax.Array) -> jax.Array:
    """What probability ``p`` adds to a key's ``moment``: p ("sum"), p^2 ("sumsq") or -p log(p + eps) ("entropy")."""
    if moment == "sum":
        return p
    if moment == "sumsq":
        return p * p
    return -p * jnp.log(p + ENTROPY_EPS)


def group_reduce_rows(x: jax.Array, group_reduce: str | None, axis: int) -> jax.Array:
    """Reduces the group axis of a per-query-head score: "mean" | "sum" | "max", or None to keep it."""
    if group_reduce is None:
        return x
    if group_reduce == "mean":
        return jnp.mean(x, axis=axis)
    if group_reduce == "sum":
        return jnp.sum(x, axis=axis)
    return jnp.max(x, axis=axis)


def combine_group_rows(rows: Sequence[jax.Array], group_reduce: str, groups: int) -> jax.Array:
    """`group_reduce_rows` inside a kernel, over a list of same-shape rows (no stacking).

    ``rows`` holds one row per group member, or a single row already summed over the group
    ("sum" / "mean"); "mean" divides by ``groups``.
    """
    red = rows[0]
    for row in rows[1:]:
        red = jnp.maximum(red, row) if group_reduce == "max" else red + row
    return red * (1.0 / groups) if group_reduce == "mean" else red
