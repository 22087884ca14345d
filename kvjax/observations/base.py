"""The observation protocol: what one observation declares and records, and the views it reads.

An observation is a frozen dataclass (its hyperparameters, e.g. a window size) subclassing
`Observation`. It declares
  keyword   the `ObservationSpec` keyword that asks for it (`ObservationSpec(window=32)`) and the
            attribute that reads it back (`spec.window`);
  fields    the `Observations` fields it fills (policies read them: `obs.window_queries`);
  phases    when the engine records it: "prefill" (a prompt prefill and its chunks) and/or "decode"
            (every decode step);
and implements
  needs(call)           what attention must return for it ("lse", "probs", "column_mass"; nothing);
  record(view, attn)    its per-layer arrays (stacked over layers by the forward);
  per_call(call)        its arrays and static values that are not per layer;
  merge / restrict      one spec serving several policies, then narrowed back to each;
  chunk_init / chunk_accumulate   what it carries across the chunks of a chunked prefill (per cache
                        slot, moved with the slots when the cache is compacted).
A producer (`producer = True`) is not recorded by the forward: it is a pass the engine runs after the
prefill (`produce`), with the policy's traced inputs (`Policy.observation_inputs()`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from flax import struct

# keyword -> Observation subclass, and every field / static field any observation records
REGISTRY: dict[str, type[Observation]] = {}
FIELDS: set[str] = {"lengths"}
STATIC_FIELDS: set[str] = {"attn_scale"}


@struct.dataclass
class CallView:
    """What every layer of one forward call shares. positions [B,n] int32 (-1 = padding); lengths [B]
    int32: real tokens per row; fresh: a prefill into an empty cache; capacity: cache slots per head
    (n without a cache); attn_scale; rope_inv_freq: the model's RoPE inverse frequencies [D/2]."""

    positions: jax.Array
    lengths: jax.Array
    fresh: bool = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False)
    attn_scale: float = struct.field(pytree_node=False)
    rope_inv_freq: tuple[float, ...] = struct.field(pytree_node=False)


@struct.dataclass
class LayerView:
    """What one (global) layer hands to its recorders: q [B,Hq,n,D] post-RoPE queries, q_raw the same
    before RoPE, k [B,Hkv,n,D] the new post-RoPE keys, v [B,Hkv,n,D] the new values, wo [Hq*D,E]
    the layer's output projection, and the call's `CallView`."""

    q: jax.Array
    q_raw: jax.Array
    k: jax.Array
    v: jax.Array
    wo: jax.Array
    call: CallView


@dataclasses.dataclass(frozen=True)
class Observation:
    keyword: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()
    static_fields: ClassVar[tuple[str, ...]] = ()
    phases: ClassVar[frozenset[str]] = frozenset({"prefill"})
    producer: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.keyword:
            REGISTRY[cls.keyword] = cls
            FIELDS.update(cls.fields)
            STATIC_FIELDS.update(cls.static_fields)

    @classmethod
    def from_keyword(cls, value: Any) -> Observation | None:
        """The observation `ObservationSpec(keyword=value)` asks for; None for "not asked" (False)."""
        return cls() if value else None

    @classmethod
    def absent(cls) -> Any:
        """What `spec.<keyword>` reads when the spec does not hold this observation."""
        return False

    def value(self) -> Any:
        """What `spec.<keyword>` reads when the spec holds it."""
        return True

    def merge(self, other: Observation) -> Observation:
        """One observation serving both (same class). Default: they must be equal."""
        if other != self:
            raise ValueError(f"{self.keyword}: one prefill records one {type(self).__name__}, got {self} and "
                             f"{other} (run these policies in separate calls)")
        return self

    def restrict(self, values: dict[str, Any]) -> dict[str, Any]:
        """This observation's fields out of `values` (recorded for a spec merged from it and others)."""
        return {f: values[f] for f in self.fields if f in values}

    def needs(self, call: CallView) -> frozenset[str]:
        return frozenset()

    def record(self, view: LayerView, attn: Any) -> dict[str, jax.Array]:
        return {}

    def per_call(self, call: CallView) -> dict[str, Any]:
        return {}

    def chunk_init(self, valid: jax.Array) -> jax.Array | None:
        """Chunked prefill: the per-slot state it carries across chunks, shaped as `valid` [L,B,Hkv,C]
        (None: nothing; the observation is then what each chunk records)."""
        return None

    def chunk_accumulate(self, values: dict[str, Any], carried: jax.Array, valid: jax.Array
                         ) -> tuple[dict[str, Any], jax.Array]:
        """Chunked prefill: this chunk's `values` combined with the `carried` state over the cache's
        `valid` slots (after the chunk's write); returns the values policies see and the new state."""
        return values, carried

    def check(self, cfg: Any, longest: int, inputs: Any) -> None:
        """Producers: host-side checks before `produce` (longest: the longest prompt)."""

    def rides_prefill(self) -> bool:
        """Producers: whether the pass can ride the prefill instead (`riding_rows`)."""
        return False

    def riding_rows(self, cfg: Any, positions: jax.Array, inputs: Any) -> Any:
        """Producers that ride the prefill: the pass as rows of the prompts' prefill (positions [B,T]),
        a `kvjax.models.forward.RidingRows` recording this observation's fields, what `produce` returns."""
        raise NotImplementedError(f"{type(self).__name__}'s pass does not ride the prefill")

    def produce(self, params: Any, cfg: Any, cache: Any, tokens: jax.Array, positions: jax.Array, *,
                rope_mode: str, inputs: Any) -> dict[str, jax.Array]:
        raise NotImplementedError(f"{type(self).__name__} is recorded by the forward, not produced after it")
