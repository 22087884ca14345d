"""The attention op: one entry point, a table of implementations, a default order per backend, and
fallback to the next implementation when one declines (tokamax's scheme).

    attention(q, keys, q_pos, *, scale, window, softcap, returns, own_keys, differentiable,
              index_causal, implementation) -> Attention(out, lse, probs, column_mass)

The caller says what it needs back besides the output (`returns`, a subset of "lse", "probs",
"column_mass") and what it knows of the keys (`own_keys`: they are the queries' own tokens, a
prefill; `index_causal`: besides, the batch is right-padded with increasing positions, so causal by
index is causal by position; `differentiable`: reverse-mode differentiable, for training). Each
implementation raises `NotImplementedError` (saying why) for shapes, key kinds or options it does
not handle, before it builds anything; the op then tries the next one. An implementation returns
what it can; the op derives the column mass from the probabilities (a sum) or from the log-sum-exp
(the two-pass column-mass kernel, a prefill without soft-cap) when the implementation did not
compute it itself.

Implementations (`IMPLEMENTATIONS`):
  cudnn         cuDNN's fused flash attention on NVIDIA GPUs (`cudnn_gpu`); a prefill's own keys in
                half precision, forward only; output only (flash when the rows are not right-padded
                and index-causal)
  xla_fused     jax.nn.dot_product_attention; own keys, index-causal, output only (training)
  splash        jax's splash attention on TPU (KVJAX_KERNEL_IMPLEMENTATION pallas_tpu / interpret);
                own keys, length a multiple of 128; out + lse (flash when not index-causal)
  decode        `kvjax.kernels.decode_attention` (its own XLA / Pallas table): one query, dense keys
                of a cache; out + probs
  flash         blocked online-softmax attention in XLA (`flash_xla`); out + lse, forward only
  segment       decode attention over `SegmentedKeys` (the ragged layout's per-head segments)
  quantized     one query over `QuantizedKeys`: the quantized decode kernel (codes dequantized inside
                it) and the full-precision window, merged; out + lse + probs
  segment_quantized  one query over `QuantizedSegmentedKeys` (the ragged layout's quantized segments):
                dequantized per segment inside the computation (`segment_quantized`) and the window,
                merged; out + lse
  dequantized   several queries over `QuantizedKeys`, through a dequantized copy (no decode path uses it)
  materialized  probabilities materialised (`reference.attend`); out + probs
  blocked       `reference.attend_blocked`: query blocks of `reference.QUERY_BLOCK`; out (+ column mass)

`IMPLEMENTATIONS` lists each with the backends whose default order includes it (`default_order`, in
table order); `$KVJAX_ATTENTION_IMPLEMENTATION` (names separated by commas) or `implementation=`
replace that order. `$KVJAX_KERNEL_IMPLEMENTATION` keeps choosing the backend
kernels inside the implementations (the decode kernel's table, splash on or off).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import _compat
from kvjax.kernels._dispatch import resolve_implementation
from kvjax.kernels.attention import cudnn_gpu, flash_xla, quantized, reference, segment_quantized, splash_tpu
from kvjax.kernels.attention.keys import Keys, QuantizedKeys, QuantizedSegmentedKeys, SegmentedKeys
from kvjax.kernels.column_mass.api import column_mass as column_mass_op
from kvjax.kernels.decode_attention.api import decode_attention
from kvjax.kernels.segment_attention import segment_decode_attention

ENV_VAR = "KVJAX_ATTENTION_IMPLEMENTATION"
RETURNS = ("lse", "probs", "column_mass")
SPLASH_BLOCK = 128  # splash attention's block size: the prefill length must be a multiple


@struct.dataclass
class Attention:
    """out [B,Hq,n,D] (q dtype); lse [B,Hq,n] float32 (0 for a query that sees nothing); probs
    [B,Hkv,G,n,S] float32; column_mass [B,Hkv,S] float32 (per key, the probability summed over the
    valid queries and the query group). Fields not asked for may be None."""

    out: jax.Array
    lse: jax.Array | None = None
    probs: jax.Array | None = None
    column_mass: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Options:
    """The static options of one call (see `attention`)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    returns: frozenset[str] = frozenset()
    own_keys: bool = False
    differentiable: bool = False
    index_causal: bool = False

    def provides(self, name: str, given: set[str]) -> None:
        """NotImplementedError (naming the implementation) unless `given` covers `returns`."""
        derivable = set(given)
        if "probs" in given or ("lse" in given and self.own_keys and self.softcap is None):
            derivable.add("column_mass")
        if missing := sorted(self.returns - derivable):
            raise NotImplementedError(f"{name} gives {sorted(given) or 'the output only'}, not {missing}")


def _dense(name: str, keys: object) -> Keys:
    if not isinstance(keys, Keys):
        raise NotImplementedError(f"{name} reads dense Keys, not {type(keys).__name__}")
    return keys


def _xla_fused(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("xla_fused", keys)
    if not (o.own_keys and o.index_causal) or o.softcap is not None or o.window is not None:
        raise NotImplementedError("xla_fused needs own, index-causal keys, no soft-cap and no window")
    o.provides("xla_fused", set())
    return Attention(out=reference.fused(q, keys.k, keys.v, o.scale))


def _cudnn(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("cudnn", keys)
    if not o.own_keys or o.differentiable or o.window is not None or o.softcap is not None or q.shape[2] == 1:
        raise NotImplementedError("cudnn takes a prefill's own keys, forward only, no window or soft-cap")
    if q.dtype not in cudnn_gpu.DTYPES:
        raise NotImplementedError(f"cudnn takes bfloat16 or float16 queries, not {q.dtype}")
    # The column mass, when asked, comes from the two-pass kernel (its own float32 lse pass): `_complete`.
    o.provides("cudnn", {"column_mass"})

    def fused():
        return cudnn_gpu.fused_attention(q, keys.k, keys.v, q_pos, o.scale)

    def flash():
        return flash_xla.flash_attention(q, keys.k, keys.v, q_pos, keys.pos, o.scale)[0]

    try:  # cuDNN absent or too old, or a shape it refuses: jax says so while tracing
        out = fused() if o.index_causal else jax.lax.cond(cudnn_gpu.right_padded_index_causal(q_pos), fused, flash)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as why:
        raise NotImplementedError(f"cudnn refused: {str(why).splitlines()[0] if str(why) else type(why).__name__}")
    return Attention(out=out)


def _splash(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("splash", keys)
    try:
        backend = resolve_implementation(None, "prefill_attention")
    except RuntimeError:
        backend = "xla"
    if backend not in ("pallas_tpu", "interpret") or not _compat.HAS_SPLASH:
        raise NotImplementedError(f"splash runs on the TPU backend (here {backend!r})")
    if not o.own_keys or o.differentiable or q.shape[2] % SPLASH_BLOCK:
        raise NotImplementedError(f"splash needs own keys, a forward pass and a length multiple of {SPLASH_BLOCK}")
    o.provides("splash", {"lse"})

    def splash():
        return splash_tpu.splash_attention(q, keys.k, keys.v, q_pos, o.scale, window=o.window, softcap=o.softcap,
                                           interpret=backend == "interpret")

    def flash():
        return flash_xla.flash_attention(q, keys.k, keys.v, q_pos, keys.pos, o.scale, window=o.window,
                                         softcap=o.softcap)

    out, lse = jax.lax.cond(splash_tpu.index_causal(q_pos), splash, flash)
    return Attention(out=out, lse=lse)


def _decode(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("decode", keys)
    if q.shape[2] != 1 or o.own_keys or o.differentiable or o.softcap is not None or o.window is not None:
        raise NotImplementedError("decode takes one query over a cache, forward only, no soft-cap or window")
    o.provides("decode", {"probs"})
    visible = (keys.pos >= 0) & (keys.pos <= q_pos[:, :1, None])
    out, probs = decode_attention(q[:, :, 0], keys.k, keys.v, visible, scale=o.scale)
    return Attention(out=out[:, :, None], probs=probs[:, :, :, None])


def _flash(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("flash", keys)
    if q.shape[2] == 1 or o.differentiable:
        raise NotImplementedError("flash takes more than one query, forward only")
    o.provides("flash", {"lse"})
    out, lse = flash_xla.flash_attention(q, keys.k, keys.v, q_pos, keys.pos, o.scale, window=o.window,
                                         softcap=o.softcap)
    return Attention(out=out, lse=lse)


def _segment(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    if not isinstance(keys, SegmentedKeys):
        raise NotImplementedError(f"segment reads SegmentedKeys, not {type(keys).__name__}")
    if q.shape[2] != 1 or o.window is not None:
        raise NotImplementedError("segment takes one query and no window")
    o.provides("segment", set())
    seg = jnp.where((keys.pos >= 0) & (keys.pos <= q_pos[:, :1]), keys.seg, -1)
    out = segment_decode_attention(q[:, :, 0], keys.k, keys.v, seg, num_kv_heads=keys.num_kv_heads, scale=o.scale,
                                   softcap=o.softcap)
    return Attention(out=out[:, :, None])


def _quantized(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    if not isinstance(keys, QuantizedKeys):
        raise NotImplementedError(f"quantized reads QuantizedKeys, not {type(keys).__name__}")
    if q.shape[2] != 1 or o.window is not None or o.differentiable:
        raise NotImplementedError("quantized takes one query, no window, forward only")
    o.provides("quantized", {"lse", "probs"})
    out, lse, probs = quantized.decode(q, keys, q_pos, scale=o.scale, softcap=o.softcap,
                                       with_probs=bool(o.returns & {"probs", "column_mass"}))
    return Attention(out=out, lse=lse, probs=probs)


def _segment_quantized(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    if not isinstance(keys, QuantizedSegmentedKeys):
        raise NotImplementedError(f"segment_quantized reads QuantizedSegmentedKeys, not {type(keys).__name__}")
    if q.shape[2] != 1 or o.window is not None or o.differentiable:
        raise NotImplementedError("segment_quantized takes one query, no window, forward only")
    o.provides("segment_quantized", {"lse"})
    out, lse = segment_quantized.decode(q, keys, q_pos, scale=o.scale, softcap=o.softcap)
    return Attention(out=out, lse=lse)


def _dequantized(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    if not isinstance(keys, QuantizedKeys):
        raise NotImplementedError(f"dequantized reads QuantizedKeys, not {type(keys).__name__}")
    o.provides("dequantized", set())
    return Attention(out=quantized.chunk(q, keys, q_pos, scale=o.scale, window=o.window, softcap=o.softcap))


def _long_prefill(q: jax.Array, o: Options) -> bool:
    n = q.shape[2]
    return o.own_keys and n > reference.QUERY_BLOCK and n % reference.QUERY_BLOCK == 0


def _materialized(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("materialized", keys)
    if _long_prefill(q, o) and "probs" not in o.returns:
        raise NotImplementedError("a long prefill that needs no probabilities attends in query blocks")
    o.provides("materialized", {"probs"})
    out, probs = reference.attend(q, keys.k, keys.v, q_pos, keys.pos, o.scale, window=o.window, softcap=o.softcap)
    return Attention(out=out, probs=probs)


def _blocked(q: jax.Array, keys: object, q_pos: jax.Array, o: Options) -> Attention:
    keys = _dense("blocked", keys)
    n = q.shape[2]
    if n <= reference.QUERY_BLOCK or n % reference.QUERY_BLOCK:
        raise NotImplementedError(f"blocked takes a multiple of QUERY_BLOCK={reference.QUERY_BLOCK} queries, above it")
    o.provides("blocked", {"column_mass"})
    out, mass = reference.blocked_column_mass(q, keys.k, keys.v, q_pos, keys.pos, o.scale, window=o.window,
                                              softcap=o.softcap, want_mass="column_mass" in o.returns)
    return Attention(out=out, column_mass=mass)


Implementation = Callable[[jax.Array, object, jax.Array, Options], Attention]
ALL_BACKENDS = ("tpu", "gpu", "cuda", "rocm", "cpu")
# name -> (implementation, the backends whose default order includes it); the default order is this
# table's order. Adding an implementation: its module, and one line here.
IMPLEMENTATIONS: dict[str, tuple[Implementation, tuple[str, ...]]] = {
    "cudnn": (_cudnn, ("gpu", "cuda")),  # before xla_fused: XLA's fused attention materialises the logits on GPUs
    "xla_fused": (_xla_fused, ALL_BACKENDS),
    "splash": (_splash, ("tpu",)),
    "decode": (_decode, ALL_BACKENDS),
    "flash": (_flash, ALL_BACKENDS),
    "segment": (_segment, ALL_BACKENDS),
    "quantized": (_quantized, ALL_BACKENDS),
    "segment_quantized": (_segment_quantized, ALL_BACKENDS),
    "dequantized": (_dequantized, ALL_BACKENDS),
    "materialized": (_materialized, ALL_BACKENDS),
    "blocked": (_blocked, ALL_BACKENDS),
}


def default_order(backend: str) -> tuple[str, ...]:
    """The implementations tried on `backend` when none is asked for, in table order."""
    return tuple(name for name, (_, backends) in IMPLEMENTATIONS.items() if backend in backends)


def order(implementation: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """The implementations to try, in order: `implementation`, else $KVJAX_ATTENTION_IMPLEMENTATION,
    else the backend's `default_order`. ValueError for an unknown name (listing the accepted ones)."""
    if implementation is None:
        env = os.environ.get(ENV_VAR)
        names = tuple(n.strip() for n in env.split(",") if n.strip()) if env else \
            default_order(jax.default_backend())
        source = f"${ENV_VAR}={env!r}" if env else "the default order"
    else:
        names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
        source = f"implementation={implementation!r}"
    if not names or any(n not in IMPLEMENTATIONS for n in names):
        raise ValueError(f"attention: {source} is not accepted; names must come from {tuple(IMPLEMENTATIONS)}")
    return names


def attention(q: jax.Array, keys: Keys | SegmentedKeys, q_pos: jax.Array, *, scale: float,
              window: int | None = None, softcap: float | None = None, returns: Sequence[str] = (),
              own_keys: bool = False, differentiable: bool = False, index_causal: bool = False,
              implementation: str | Sequence[str] | None = None) -> Attention:
    """Causal attention by position of queries q [B,Hq,n,D] at q_pos [B,n] (-1 = padding) over `keys`.

    Query i sees a slot iff 0 <= its position <= q_pos[i] (and q_pos[i] - position < window when
    given); softcap: logits -> softcap * tanh(logits / softcap) first (Gemma 2). A query that sees
    nothing gets zeros (never NaN). returns: what to compute besides the output ("lse", "probs",
    "column_mass"). The first implementation of `order(implementation)` that accepts the call runs;
    NotImplementedError lists why each declined when none does.
    """
    asked = frozenset(returns)
    if bad := sorted(asked - set(RETURNS)):
        raise ValueError(f"attention: returns={sorted(asked)} has {bad}; accepted values: {RETURNS}")
    opts = Options(scale=float(scale), window=window, softcap=softcap, returns=asked, own_keys=own_keys,
                   differentiable=differentiable, index_causal=index_causal)
    declined = []
    for name in order(implementation):
        try:
            result = IMPLEMENTATIONS[name][0](q, keys, q_pos, opts)
        except NotImplementedError as why:
            declined.append(f"{name} ({why})")
            continue
        return _complete(result, q, keys, q_pos, opts)
    raise NotImplementedError(f"no attention implementation accepts these inputs: {'; '.join(declined)}")


def _complete(result: Attention, q: jax.Array, keys: Keys | SegmentedKeys, q_pos: jax.Array, o: Options
              ) -> Attention:
    """Adds the column mass when it was asked for and the implementation did not compute it."""
    if "column_mass" not in o.returns or result.column_mass is not None:
        return result
    if result.probs is not None:  # padding queries see no key: their rows of probs are zero
        return result.replace(column_mass=jnp.sum(result.probs, axis=(2, 3)))
    return result.replace(column_mass=column_mass_op(q, keys.k, q_pos, keys.pos, scale=o.scale, lse=result.lse))
