"""The engine's jitted programs: model prefill (with a producer's pass riding it, where one can), the
observation passes run after it (producers),
policy compression, chunked prefill (a chunk appended then evicted, and the final compaction), chunk
feed and the decode loop. Nothing here names a policy or an observation: specs are filtered by phase,
producers run through `produce`, and every cache layout offers the same interface.

Each program compiles once per static configuration (bucket, batch size, observation spec,
policy, capacity, decode-step bucket) and is reused by later calls; `TRACE_COUNTS` counts the
compilations, per program.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, gather_slots
from kvjax import cache_quant, cache_quant_ragged
from kvjax.cache_ragged import Layout, RaggedCache, from_cache
from kvjax.kv_quant import KVQuant
from kvjax.models.config import ModelConfig
from kvjax.models.forward import extend, split_layers
from kvjax.models.local import init_cache
from kvjax.observations import Observation, Observations, ObservationSpec
from kvjax.policies.base import Plan, Policy, compress_prefill
from kvjax.sampling import Sampler

# Compilations so far, per jitted function (traced once per distinct static configuration).
TRACE_COUNTS: collections.Counter = collections.Counter()


def constrain(cache, mesh: jax.sharding.Mesh | None):
    """The cache laid out over the mesh (its layout's `shardings`: batch over `data`, KV heads over `model`)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache.shardings(mesh))


def prefill_spec(policies: list[Policy | None]) -> ObservationSpec:
    """What one model prefill shared by `policies` must record: the union of their prefill-phase
    observations (decode-phase ones and the passes run after the prefill are not recorded there)."""
    return ObservationSpec.union(p.requirements().observe.phase("prefill") for p in policies if p is not None)


def riding_pass(policies: list[Policy | None], mode: str) -> tuple[Observation, Any] | None:
    """The producer pass (observation, traced inputs) that rides the prefill of `policies` in RoPE mode
    `mode`: the one producer pass they ask for, when it can ride (`Observation.rides_prefill`), the mode is
    "original" and the prefill records none of its fields; None otherwise (passes then run after it)."""
    passes = {(o, id(p.observation_inputs())): (o, p.observation_inputs())
              for p in policies if p is not None for o in p.requirements().observe.producers}
    if len(passes) != 1 or mode != "original":
        return None
    (o, inputs), = passes.values()
    recorded = {f for x in prefill_spec(policies) for f in x.fields}
    return (o, inputs) if o.rides_prefill() and not recorded & set(o.fields) else None


def rope_mode(policy: Policy | None) -> str:
    return "original" if policy is None else policy.requirements().rope_mode


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "observe", "rope_mode", "sampler", "mesh", "riding"))
def prefill(params, tokens: jax.Array, positions: jax.Array, key: jax.Array, *, cfg: ModelConfig, capacity: int,
            observe: ObservationSpec, rope_mode: str, sampler: Sampler, mesh, riding: Observation | None = None,
            riding_inputs: Any = None) -> tuple[jax.Array, KVCache, Observations, jax.Array]:
    """The model prefill, shared by every policy. tokens, positions [B,T] (right-padded, -1 = padding).
    riding: a producer whose pass rides the prefill (`Observation.rides_prefill`), with its traced inputs
    `riding_inputs`: its fields come with the prefill's observations, as `produce` would give them.

    Returns first-token ids [B], the full cache of `capacity` slots (global layers; the rolling
    buffers of sliding-window layers in `cache.local`), the `Observations` asked for, and the
    first-token logits [B,V].
    """
    TRACE_COUNTS["prefill"] += 1
    B = tokens.shape[0]
    lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
    cache = constrain(init_cache(cfg, B, capacity), mesh)
    rows = None if riding is None else riding.riding_rows(cfg, positions, riding_inputs)
    logits, cache, observations = extend(params, cfg, cache, tokens, positions, fresh=True, observe=observe,
                                         logit_index=(lengths - 1)[:, None], rope_mode=rope_mode, riding=rows)
    return sampler(logits[:, 0], key), cache, observations, logits[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "observation", "rope_mode"))
def produce(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, inputs, *, cfg: ModelConfig,
            observation: Observation, rope_mode: str) -> dict[str, jax.Array]:
    """A pass after the prompt prefill (a producer observation: KVzip's reconstruction, LookaheadKV's
    tokens) over the prefilled `cache` of the prompts tokens / positions [B,T], with the policy's
    traced `inputs`; the cache is left unchanged. Returns the observation's fields."""
    TRACE_COUNTS[f"produce:{observation.keyword}"] += 1
    return observation.produce(params, cfg, cache, tokens, positions, rope_mode=rope_mode, inputs=inputs)


@functools.partial(jax.jit, static_argnames=("policy", "capacity", "mesh"))
def compress(cache: KVCache, observations: Observations, plan: Plan, *, policy: Policy, capacity: int, mesh
             ) -> tuple[KVCache, object]:
    """The policy's prefill eviction on a full cache (`compress_prefill`): the compacted (or
    masked) cache and the policy's decode state."""
    TRACE_COUNTS["compress"] += 1
    cache, state = compress_prefill(policy, plan, cache, observations, capacity=capacity)
    return constrain(cache, mesh), state


def chunk_spec(policy: Policy) -> ObservationSpec:
    """What each chunk of a chunked prefill records for `policy`: its own prefill-time needs."""
    return prefill_spec([policy])


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "capacity", "mesh"))
def empty_cache(*, cfg: ModelConfig, batch: int, capacity: int, mesh) -> KVCache:
    """An empty cache of `capacity` slots per head (a chunked prefill's working buffer)."""
    return constrain(init_cache(cfg, batch, capacity), mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "observe", "rope_mode", "mesh"),
                   donate_argnames=("cache", "carried"))
def prefill_chunk(params, cache: KVCache, carried: dict[str, jax.Array], seen: jax.Array, tokens: jax.Array,
                  positions: jax.Array, plan: Plan, *, cfg: ModelConfig, policy: Policy, observe: ObservationSpec,
                  rope_mode: str, mesh) -> tuple[jax.Array, KVCache, dict[str, jax.Array], jax.Array, object]:
    """One chunk of a chunked prefill: appends the chunk to the cache, scores the cache with the
    policy and evicts down to its budget, compacting the survivors into the same buffer.

    cache: capacity (kept after prefill) + chunk slots, the survivors of earlier chunks first (in
    position order). tokens, positions [B,n]: each row's chunk, right-padded (-1), possibly empty
    (a row whose prompt starts in a later chunk, or has ended). seen [B]: prompt tokens fed so far.
    carried: what the spec's observations carry across chunks (`ObservationSpec.chunk_init`: e.g. the
    column mass every query fed so far put on each surviving slot), per slot [L,B,Hkv,C].
    The policy scores as if the prompt ended with this chunk: `plan.lengths` becomes `seen` + the
    chunk (its window = the chunk's last `window` queries, its protected tokens the prompt's last
    ones so far); counts stay the whole prompt's. Rows with no real token in the chunk are left as
    they are. Returns the logits of each row's last real token in the chunk [B,V], the compacted
    cache, the carried states (moved with the slots), the new `seen` and the policy's per-slot state.
    The same program serves every chunk of every prompt of a bucket (static shapes).
    """
    TRACE_COUNTS["prefill_chunk"] += 1
    B = tokens.shape[0]
    real = positions >= 0
    n_real = jnp.sum(real, axis=-1).astype(jnp.int32)
    active = n_real > 0
    logits, cache, obs = extend(params, cfg, cache, tokens, positions, fresh=False, observe=observe,
                                logit_index=jnp.maximum(n_real - 1, 0)[:, None], rope_mode=rope_mode)
    obs, carried = observe.chunk_accumulate(obs, carried, cache.valid)
    last = jnp.max(jnp.where(real, positions, -1), axis=-1) + 1
    seen = jnp.where(active, last, seen).astype(jnp.int32)
    so_far = plan.replace(lengths=tuple(seen[b] for b in range(B)))
    keep, slot_state = policy.prefill_keep(so_far, cache, obs)
    keep = jnp.where(active[None, :, None, None], keep, cache.valid)
    cache, src = cache.compact(keep, cache.capacity)
    carried = jax.tree.map(lambda x: jnp.where(cache.valid, gather_slots(x, src), 0), carried)
    if slot_state is not None:
        slot_state = jax.tree.map(lambda x: gather_slots(x, src), slot_state)
    return logits[:, 0], constrain(cache, mesh), carried, seen, slot_state


@functools.partial(jax.jit, static_argnames=("policy", "mesh"))
def finish_chunks(cache: KVCache, slot_state, plan: Plan, *, policy: Policy, mesh) -> tuple[KVCache, object]:
    """After the last chunk: the survivors moved into a cache of the plan's capacity (decode room
    included) and the policy's decode state, as `compress` returns them after a one-shot prefill."""
    TRACE_COUNTS["finish_chunks"] += 1
    cache, src = cache.compact(cache.valid, plan.capacity)
    if slot_state is not None:
        slot_state = jax.tree.map(lambda x: gather_slots(x, src), slot_state)
    return constrain(cache, mesh), policy.init_decode(plan, cache, slot_state)


@functools.partial(jax.jit, static_argnames=("capacity", "mesh"))
def grow(cache: KVCache, *, capacity: int, mesh) -> KVCache:
    """The same cache with empty slots appended up to `capacity` (slot layout unchanged)."""
    return constrain(cache.grow(capacity), mesh)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "rope_mode"))
def feed(params, cache: KVCache, tokens: jax.Array, positions: jax.Array, logit_index: jax.Array, *,
         cfg: ModelConfig, mesh, rope_mode: str = "original") -> tuple[jax.Array, KVCache]:
    """Appends a chunk (a question, a continuation) [B,n] to a filled cache; logits [B,k,V] at
    `logit_index` [B,k]."""
    TRACE_COUNTS["feed"] += 1
    logits, cache, _ = extend(params, cfg, cache, tokens, positions, fresh=False, logit_index=logit_index,
                              rope_mode=rope_mode)
    return logits, constrain(cache, mesh)


@functools.partial(jax.jit, static_argnames=("layout", "room", "kv_quant"))
def to_ragged(cache: KVCache, *, layout: Layout, room: int, kv_quant: KVQuant | None = None) -> RaggedCache:
    """The cache's entries in the per-layer `layout` (`kvjax.cache_ragged`), `room` free slots per head;
    quantized (`kvjax.cache_quant_ragged`) when `kv_quant` is given."""
    TRACE_COUNTS["to_ragged"] += 1
    if kv_quant is not None:
        return cache_quant_ragged.from_cache(cache, layout, room, kv_quant)
    return from_cache(cache, layout, room)


@functools.partial(jax.jit, static_argnames=("config", "room", "reuse_slots"))
def to_quantized(cache: KVCache, *, config: KVQuant, room: int | None = None, reuse_slots: bool = False
                 ) -> cache_quant.QuantizedKVCache:
    """The cache's entries quantized (`kvjax.cache_quant`), the same slots and positions; a full-precision
    window for `room` decode appends (None: the configuration's whole `residual`); reuse_slots: decode
    appends take the slots evictions free (decode-time eviction, per-token scales)."""
    TRACE_COUNTS["to_quantized"] += 1
    return cache_quant.from_cache(cache, config, room, reuse_slots)


def row_entries(cache: KVCache | RaggedCache) -> jax.Array:
    """KV entries per row, summed over layers and heads: [B] float32."""
    return cache.row_entries()


@struct.dataclass
class DecodeState:
    """The `lax.while_loop` carry of `decode`.

    step: index of the next token to write into `tokens` [B, steps]; last [B]: the last token of
    each row; pos [B]: its next position; done [B]: rows that emitted a stop token;
    policy_state: the decode-time policy's state (None for the others);
    kept_min / kept_max / kept_sum [B]: KV entries of each row (summed over layers and heads) after
    each step while the row generates, and `active_steps` [B] how many such states were counted;
    bytes_max / bytes_sum [B]: their key/value bytes at 16 bits per element (codes and scales for a
    quantized cache: `row_kv_bytes`).
    """

    step: jax.Array
    tokens: jax.Array
    cache: KVCache
    policy_state: object
    last: jax.Array
    pos: jax.Array
    done: jax.Array
    key: jax.Array
    kept_min: jax.Array
    kept_max: jax.Array
    kept_sum: jax.Array
    active_steps: jax.Array
    bytes_max: jax.Array
    bytes_sum: jax.Array

    def count_kept(self, active: jax.Array) -> "DecodeState":
        """Adds the cache's current entries to the statistics of the `active` rows."""
        n, nb = row_entries(self.cache), self.cache.row_kv_bytes()
        return self.replace(kept_min=jnp.where(active, jnp.minimum(self.kept_min, n), self.kept_min),
                            kept_max=jnp.where(active, jnp.maximum(self.kept_max, n), self.kept_max),
                            kept_sum=self.kept_sum + jnp.where(active, n, 0.0),
                            active_steps=self.active_steps + active.astype(jnp.int32),
                            bytes_max=jnp.where(active, jnp.maximum(self.bytes_max, nb), self.bytes_max),
                            bytes_sum=self.bytes_sum + jnp.where(active, nb, 0.0))


# On a GPU the decode loop runs as CUDA graphs, its while loop and conditionals included (XLA's default graphs
# leave them out: each step then launches its ~500 kernels one by one). Given to GPU compiles only.
DECODE_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"}


def layers_in_a_loop(cache: KVCache) -> bool:
    """Whether decode runs its layers in a Python loop over params split once per layer, rather than a scan
    over the stacked params: a cache stored per layer needs it, and on a GPU the scan copies each layer's
    MLP weights at every step (3 copies a layer, a quarter of an H200's decode step; eval/device/README.md)."""
    return not cache.stacked or jax.default_backend() == "gpu"


def decode(params, cache: KVCache, policy_state, first: jax.Array, pos0: jax.Array, key: jax.Array, plan: Plan | None,
           limit: jax.Array, *, cfg: ModelConfig, steps: int, policy: Policy | None, sampler: Sampler,
           stop_ids: tuple[int, ...], pad_id: int, mesh, rope_mode: str) -> DecodeState:
    """`_decode`, compiled for the default backend (`decode_program`)."""
    return decode_program()(params, cache, policy_state, first, pos0, key, plan, limit, cfg=cfg, steps=steps,
                            policy=policy, sampler=sampler, stop_ids=stop_ids, pad_id=pad_id, mesh=mesh,
                            rope_mode=rope_mode)


def _decode(params, cache: KVCache, policy_state, first: jax.Array, pos0: jax.Array, key: jax.Array, plan: Plan | None,
            limit: jax.Array, *, cfg: ModelConfig, steps: int, policy: Policy | None, sampler: Sampler,
            stop_ids: tuple[int, ...], pad_id: int, mesh, rope_mode: str) -> DecodeState:
    """Decodes up to `limit - 1` (traced, <= steps) tokens after `first` [B] under `lax.while_loop`.

    Returns the final `DecodeState` (tokens [B, steps], pad after `limit`). `policy` (with its
    `plan` and `policy_state`) is given only for decode-time eviction; every other policy shares
    the plain loop of its cache capacity. Any cache layout decodes through the same `extend` (a
    `RaggedCache`: one compilation per layout; no decode-time eviction).
    """
    TRACE_COUNTS["decode"] += 1
    B = first.shape[0]
    stops = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    spec = ObservationSpec() if policy is None else policy.requirements().observe.phase("decode")
    big = jnp.full((B,), jnp.inf, jnp.float32)
    state = DecodeState(step=jnp.int32(1), tokens=jnp.full((B, steps), pad_id, jnp.int32).at[:, 0].set(first),
                        cache=cache, policy_state=policy_state, last=first, pos=pos0, done=jnp.isin(first, stops),
                        key=key, kept_min=big, kept_max=-big, kept_sum=jnp.zeros((B,), jnp.float32),
                        active_steps=jnp.zeros((B,), jnp.int32), bytes_max=-big, bytes_sum=jnp.zeros((B,), jnp.float32))
    state = state.count_kept(jnp.ones((B,), bool))
    if (policy is not None or rope_mode != "original") and not cache.stacked:
        raise ValueError("decode: decode-time eviction and rope_mode 'cache_relative' need the dense KVCache layout")
    layer_params = split_layers(params) if layers_in_a_loop(cache) else params  # sliced once, outside the loop

    def cond(s: DecodeState) -> jax.Array:
        return (s.step < limit) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        slots = s.cache.write_slots(1)
        q_pos = jnp.where(s.done, -1, s.pos)[:, None]
        logits, cache, obs = extend(layer_params, cfg, s.cache, s.last[:, None], q_pos, fresh=False, observe=spec,
                                    slots=slots, rope_mode=rope_mode)
        key, sub = jax.random.split(s.key)
        nxt = jnp.where(s.done, pad_id, sampler(logits[:, 0], sub))
        policy_state = s.policy_state
        if policy is not None:
            policy_state, keep = policy.decode_step(plan, policy_state, cache, obs, slots[..., 0], s.step)
            cache = cache.evict(keep)
        active = ~s.done
        s = s.replace(step=s.step + 1, tokens=s.tokens.at[:, s.step].set(nxt), cache=constrain(cache, mesh),
                      policy_state=policy_state, last=nxt, pos=s.pos + 1, done=s.done | jnp.isin(nxt, stops), key=key)
        return s.count_kept(active)

    return jax.lax.while_loop(cond, body, state)


_DECODE_JIT = dict(static_argnames=("cfg", "steps", "policy", "sampler", "stop_ids", "pad_id", "mesh", "rope_mode"),
                   donate_argnames=("cache",))
_DECODE_PROGRAMS = {"gpu": jax.jit(_decode, **_DECODE_JIT, compiler_options=DECODE_COMPILER_OPTIONS),
                    None: jax.jit(_decode, **_DECODE_JIT)}


def decode_program():
    """The jitted `_decode` for the default backend: on GPUs with `DECODE_COMPILER_OPTIONS`."""
    backend = jax.default_backend()
    return _DECODE_PROGRAMS["gpu" if backend == "gpu" else None]
