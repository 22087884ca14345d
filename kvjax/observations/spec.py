"""`ObservationSpec`: what to record (static, hashable); `Observations`: what was recorded (a pytree).

Policies declare a spec inside their `Requirements` (`ObservationSpec(window=32, column_mass=True)`,
or observation objects: `ObservationSpec(Reconstruction(...))`), the engine merges the specs of the
policies that share a prefill, the forward records exactly that, and each policy gets the
observations restricted back to its own spec. Nothing here names an observation: every loop runs
over the spec's items (`kvjax.observations.base.Observation`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax

from kvjax.observations.base import FIELDS, REGISTRY, STATIC_FIELDS, CallView, LayerView, Observation


class ObservationSpec:
    """A frozen, sorted set of observations (one per kind): a jit static argument.

    ObservationSpec(*observations, **keywords): keywords name registered observations
    (`kvjax.observations.REGISTRY`: window=, column_mass=, step_probs=, output_norms=, output_norms_l2=,
    output_norms_rms=, query_stats=, query_mass=) with their value; an observation object may be given by its
    keyword too. A falsy
    value (0, False, -1, None) asks for nothing. `spec.<keyword>` reads the value back (the
    observation's `absent()` when the spec does not hold it).
    """

    __slots__ = ("items",)

    def __init__(self, *observations: Observation, **keywords: Any) -> None:
        items = list(observations)
        for key, value in keywords.items():
            if isinstance(value, Observation):
                items.append(value)
            elif key in REGISTRY:
                if (made := REGISTRY[key].from_keyword(value)) is not None:
                    items.append(made)
            elif value not in (None, False, 0, -1):
                raise TypeError(f"ObservationSpec: unknown observation {key!r}; registered: {sorted(REGISTRY)}")
        by_kind: dict[str, Observation] = {}
        for o in items:
            if not isinstance(o, Observation):
                raise TypeError(f"ObservationSpec takes Observation objects, got {type(o).__name__}")
            by_kind[o.keyword] = by_kind[o.keyword].merge(o) if o.keyword in by_kind else o
        object.__setattr__(self, "items", tuple(by_kind[k] for k in sorted(by_kind)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ObservationSpec is immutable")

    def __getattr__(self, name: str) -> Any:
        cls = REGISTRY.get(name)
        if cls is None:
            raise AttributeError(f"ObservationSpec has no observation {name!r}; registered: {sorted(REGISTRY)}")
        held = self.get(cls)
        return cls.absent() if held is None else held.value()

    def get(self, cls: type[Observation]) -> Observation | None:
        return next((o for o in self.items if type(o) is cls), None)

    def __iter__(self) -> Iterator[Observation]:
        return iter(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObservationSpec) and self.items == other.items

    def __hash__(self) -> int:
        return hash(self.items)

    def __repr__(self) -> str:
        return f"ObservationSpec({', '.join(map(repr, self.items))})"

    def merge(self, other: ObservationSpec) -> ObservationSpec:
        """What both need (each kind merged: the wider window, ...); ValueError when two cannot share."""
        return ObservationSpec(*self.items, *other.items)

    @classmethod
    def union(cls, specs: Iterable[ObservationSpec]) -> ObservationSpec:
        return cls(*(o for spec in specs for o in spec.items))

    def phase(self, phase: str) -> ObservationSpec:
        """The observations the forward records in `phase` ("prefill" or "decode"); producers excluded."""
        return ObservationSpec(*(o for o in self.items if phase in o.phases and not o.producer))

    @property
    def producers(self) -> tuple[Observation, ...]:
        """The passes the engine runs after the prefill."""
        return tuple(o for o in self.items if o.producer)

    def needs(self, call: CallView) -> frozenset[str]:
        """What attention must return for this call's recorders."""
        return frozenset().union(*(o.needs(call) for o in self.items if not o.producer))

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for o in self.items:
            if not o.producer:
                out.update(o.record(view, attn))
        return out

    def per_call(self, call: CallView) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in self.items:
            if not o.producer:
                out.update(o.per_call(call))
        return out

    def chunk_init(self, valid: jax.Array) -> dict[str, jax.Array]:
        """Chunked prefill: the per-slot states its observations carry across chunks, by keyword."""
        return {o.keyword: s for o in self.items if (s := o.chunk_init(valid)) is not None}

    def chunk_accumulate(self, obs: Observations, carried: dict[str, jax.Array], valid: jax.Array
                         ) -> tuple[Observations, dict[str, jax.Array]]:
        """This chunk's observations combined with the carried states; returns both, updated."""
        values, out = dict(obs.values), {}
        for o in self.items:
            if o.keyword in carried:
                values, out[o.keyword] = o.chunk_accumulate(values, carried[o.keyword], valid)
        return Observations(values, obs.static), out


@jax.tree_util.register_pytree_node_class
class Observations:
    """What the forward (and the producers) recorded: arrays by field name (absent fields read as None),
    plus static values (`attn_scale`, `rope_inv_freq`). Fields are those the registered observations
    declare (`obs.window_queries`, `obs.column_mass`, ...) and `lengths` [B] int32, the real tokens per
    row of the call (the prompt lengths, for a prefill); each observation module documents its shapes.
    """

    __slots__ = ("values", "static")

    def __init__(self, values: dict[str, Any] | None = None, static: dict[str, Any] | None = None, **fields: Any):
        vals = {k: v for k, v in (values or {}).items() if v is not None}
        stat = {k: v for k, v in (static or {}).items() if v is not None}
        for k, v in fields.items():
            if k not in FIELDS and k not in STATIC_FIELDS:
                raise TypeError(f"Observations: unknown field {k!r}; known: {sorted(FIELDS | STATIC_FIELDS)}")
            if v is not None:
                (stat if k in STATIC_FIELDS else vals)[k] = v
        object.__setattr__(self, "values", vals)
        object.__setattr__(self, "static", stat)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Observations is immutable: use .replace(...)")

    def __getattr__(self, name: str) -> Any:
        if name in FIELDS:
            return self.values.get(name)
        if name in STATIC_FIELDS:
            return self.static.get(name)
        raise AttributeError(f"Observations has no field {name!r}; known: {sorted(FIELDS | STATIC_FIELDS)}")

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        keys = tuple(sorted(self.values))
        return tuple(self.values[k] for k in keys), (keys, tuple(sorted(self.static.items())))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Iterable[Any]) -> Observations:
        keys, static = aux
        obs = object.__new__(cls)
        object.__setattr__(obs, "values", dict(zip(keys, children)))
        object.__setattr__(obs, "static", dict(static))
        return obs

    def replace(self, **fields: Any) -> Observations:
        """The same observations with `fields` set (None removes one)."""
        merged = Observations(self.values, self.static)
        for k, v in fields.items():
            if k not in FIELDS and k not in STATIC_FIELDS:
                raise TypeError(f"Observations: unknown field {k!r}; known: {sorted(FIELDS | STATIC_FIELDS)}")
            target = merged.static if k in STATIC_FIELDS else merged.values
            if v is None:
                target.pop(k, None)
            else:
                target[k] = v
        return merged

    def restrict(self, spec: ObservationSpec) -> Observations:
        """The observations a narrower `spec` asks for (these were recorded for a spec merged from it
        and others): each of its observations narrowed (a window cut to its last queries), the others
        dropped; `lengths` and the static values stay."""
        values = {"lengths": self.values["lengths"]} if "lengths" in self.values else {}
        for o in spec:
            values.update(o.restrict(self.values))
        return Observations(values, self.static)
