"""Budget allocators: turn a budget into kept counts per (layer, row, KV head) (policies.md §6-8).

An allocator composes with any prefill scorer. Its host half (`allocate`) runs in Python
float64 exactly as the reference code does and returns an `Allocation` ([L][B] tuples: L layers,
B rows); its traced half (`head_counts`) turns scores into per-head counts [L,B,Hkv] inside jit.
Uniform and Pyramid are static; Ada (head-wise, data-dependent), Global (one budget per layer or
per row) and Cake (layer-wise from attention statistics) are traced, realised as masks within a
static capacity bound, and hand their traced half its inputs in `Plan.alloc` (`AdaData`,
`GlobalData`, `CakeData`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache
from kvjax.observations import Observations, ObservationSpec
from kvjax.policies.base import (
    AllocData,
    Plan,
    PlanRequest,
    Requirements,
    as_bool,
    as_i32,
    check_choice,
    check_float,
    check_int,
    select,
)
from kvjax.policies.scoring import Scored, attention_scale, last_window, window_moments

RULES = ("paper", "kvpress")


Rows = Sequence[Sequence[int]]  # [B][L], as the allocators compute them (one row at a time)


def by_layer(rows: Rows, kind: type = int) -> tuple[tuple, ...]:
    """[B][L] lists -> the [L][B] tuples of `Plan` and `Allocation` (elements cast by `kind`)."""
    return tuple(tuple(kind(x) for x in col) for col in zip(*rows))


@struct.dataclass(frozen=True, kw_only=True)
class AdaData(AllocData):
    """Ada-KV's plan data. floor: [L][B] the entries every head keeps before the shared pick (rule
    "paper": int(B' alpha), added to each head's share; rule "kvpress": n_safe, each head's top n_safe)."""

    floor: tuple[tuple[int, ...], ...] = ()


@struct.dataclass(frozen=True, kw_only=True)
class GlobalData(AllocData):
    """Global's plan data. group_total: [L][B] entries kept by the group that shares one budget (the
    layer's KV heads, or every layer's when across_layers; then equal across layers)."""

    group_total: tuple[tuple[int, ...], ...] = ()


@struct.dataclass(frozen=True, kw_only=True)
class CakeData(AllocData):
    """CAKE's plan data. clip: [L][B] the most non-window entries one layer may keep (CAKE's bound on
    b_l, equal across layers)."""

    clip: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Allocation:
    """An allocator's host result, [L][B] tuples.

    counts:     as `Plan.counts`.
    bound:      the most entries any head of (layer, row) may keep after prefill (sizes the cache).
    compressed: whether prefill evicts from (layer, row): counts < T, or the allocator compresses it.
    data:       the allocator's data for its traced half (`Plan.alloc`); None for static allocators.
    """

    counts: tuple[tuple[int, ...], ...]
    bound: tuple[tuple[int, ...], ...]
    compressed: tuple[tuple[bool, ...], ...]
    data: AllocData | None = None

    @classmethod
    def from_rows(cls, lengths: Sequence[int], counts: Rows, bound: Rows, data: AllocData | None = None) -> "Allocation":
        """From per-row [B][L] counts and bounds; `data` is already [L][B]."""
        counts_lb = by_layer(counts)
        compressed = tuple(tuple(c < t for c, t in zip(row, lengths)) for row in counts_lb)
        if data is not None:
            compressed = tuple(tuple(a or b for a, b in zip(r, d)) for r, d in zip(compressed, data.compressed))
        return cls(counts_lb, by_layer(bound), compressed, data)

    @property
    def evicts(self) -> bool:
        """Whether prefill evicts anything."""
        return any(any(row) for row in self.compressed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocator:
    """Base allocator: per-(layer, row) counts from the host plan, identical across heads."""

    def requirements(self) -> Requirements:
        return Requirements()

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        """The host plan for `req`; `protect`: protected prompt tokens per row (window, sinks),
        counted inside the budget; `compat`: the kvpress version whose arithmetic to follow."""
        raise NotImplementedError

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations, protect: int) -> jax.Array:
        """Per-head kept counts [L,B,Hkv] int32 (protected tokens included)."""
        counts = as_i32(plan.counts)
        return jnp.broadcast_to(counts[:, :, None], cache.valid.shape[:3])


# ----------------------------------------------------------------------------- uniform


@dataclasses.dataclass(frozen=True, kw_only=True)
class Uniform(Allocator):
    """Every layer and head keeps min(C, T) (or kvpress's int(T(1-r)) for a ratio)."""

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        rows = [[min(c, t)] * req.num_layers for c, t in zip(req.row_budgets(compat), req.lengths)]
        return Allocation.from_rows(req.lengths, rows, rows)


# ----------------------------------------------------------------------------- pyramid


def pyramid_paper(length: int, budget: int, window: int, num_layers: int, beta: int) -> list[int]:
    """KVCache-Factory's integer PyramidKV rule: kept tokens per layer, window included (§6)."""
    T, C, w = length, budget, window
    if T < C:
        return [T] * num_layers
    b0 = C - w
    if T < 2 * b0 or num_layers == 1:
        return [min(T, b0 + w)] * num_layers
    min_ = b0 // beta
    max_ = 2 * b0 - min_
    if max_ >= T - w:
        max_ = T - w
        min_ = 2 * b0 - max_
    step = (max_ - min_) // (num_layers - 1)
    return [min(T, max(0, max_ - l * step) + w) for l in range(num_layers)]


def pyramid_kvpress(length: int, kept: float, window: int, num_layers: int, beta: int) -> list[int]:
    """kvpress's float PyramidKV rule with round(); `kept` = T*(1-r); window included (§6)."""
    T, K, w = length, kept, window
    min_ = K / beta
    max_ = 2 * K - min_
    if max_ >= T - w:
        max_ = T - w
        min_ = 2 * K - max_
    if not (T >= max_ >= min_ >= w) or num_layers == 1:
        return [min(T, round(K))] * num_layers
    return [min(T, round(max_ - l * (max_ - min_) / (num_layers - 1))) for l in range(num_layers)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pyramid(Allocator):
    """PyramidKV's linearly decreasing per-layer budgets, uniform across heads.

    rule="paper": KVCache-Factory's integer rule (no compression if T < C; uniform if T < 2(C-w)).
    rule="kvpress": kvpress's float rule with round() and its uniform fallback.
    """

    beta: int = 20
    rule: str = "paper"

    def __post_init__(self) -> None:
        check_int("beta", self.beta, 1)
        check_choice("rule", self.rule, RULES)

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        rows = []
        for t, c in zip(req.lengths, req.row_budgets(compat)):
            if self.rule == "paper":
                rows.append(pyramid_paper(t, c, protect, req.num_layers, self.beta))
            else:
                k = t * (1 - req.ratio) if req.ratio is not None else float(req.budget)
                rows.append(pyramid_kvpress(t, k, protect, req.num_layers, self.beta))
        return Allocation.from_rows(req.lengths, rows, rows)


# ----------------------------------------------------------------------------- Ada-KV


def ada_pyramid_base(length: int, base: int, window: int, num_layers: int, beta: int) -> list[int]:
    """Ada-KV's pyram mode: the per-layer non-window capacity (no short-prompt branches)."""
    min_ = base // beta
    max_ = 2 * base - min_
    if max_ >= length - window:
        max_ = length - window
        min_ = 2 * base - max_
    step = (max_ - min_) // (num_layers - 1) if num_layers > 1 else 0
    return [max_ - l * step for l in range(num_layers)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ada(Allocator):
    """Ada-KV head-wise allocation within each layer, over any scorer (a wrapper, like AdaKVPress).

    rule="paper" (FFY0/AdaKV): B' = C - w non-window entries per head on average; no compression
      when C > T, nor in a layer whose B' > T - w (pyram mode); the global top Hkv*B' non-window
      scores give count_h per head and cap_h = round(count_h*(1-alpha) + int(B'*alpha)), so the
      layer total is Hkv*B' only up to that rounding; layers < skip keep B' per head;
      `pyramid_beta` switches on pyram mode (B' per layer from the PyramidKV schedule);
      `normalize` weights each head by (sum of its top-B' scores)/(sum of its scores).
    rule="kvpress" (AdaKVPress): n_kept = int(T(1-r)) including the window; each head's top
      n_safe = int(n_kept*alpha) first, then a global top-k over the rest.
    """

    alpha: float = 0.2
    rule: str = "paper"
    normalize: bool = False
    skip: int = 0
    pyramid_beta: int | None = None

    def __post_init__(self) -> None:
        check_float("alpha", self.alpha, 0.0, 1.0)
        check_choice("rule", self.rule, RULES)
        if not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool, got {self.normalize!r}")
        check_int("skip", self.skip, 0)
        if self.pyramid_beta is not None:
            check_int("pyramid_beta", self.pyramid_beta, 1)
        if self.rule == "kvpress" and (self.normalize or self.skip or self.pyramid_beta is not None):
            raise ValueError("normalize, skip and pyramid_beta belong to rule='paper'; AdaKVPress has none of them")

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        w, H, L = protect, req.num_kv_heads, req.num_layers
        counts, bound, floors, compressed = [], [], [], []
        for t, c in zip(req.lengths, req.row_budgets(compat)):
            rc, rb, rf, rz = [], [], [], []
            if self.rule == "kvpress":
                n_kept = min(c, t)
                n_safe = int(n_kept * self.alpha)
                if compat != "0.5.4" and n_kept > 0:
                    n_safe = max(1, n_safe)
                compress = n_kept < t
                rc, rf, rz = [n_kept] * L, [n_safe if compress else 0] * L, [compress] * L
                rb = [min(t, n_safe + H * (n_kept - n_safe)) if compress else t] * L
            else:
                whole = c > t  # §1.1: Ada-KV leaves the prompt whole when C - w > T - w
                if whole:
                    bases = [t] * L
                elif self.pyramid_beta is not None:
                    bases = ada_pyramid_base(t, c - w, w, L, self.pyramid_beta)
                else:
                    bases = [c - w] * L
                for l, bp in enumerate(bases):
                    if whole or bp > t - w:  # no compression (`whole` also with no protected tokens, w = 0)
                        rc.append(t), rf.append(0), rz.append(False), rb.append(t)
                        continue
                    floor = int(bp * self.alpha)
                    # a negative floor (a budget below the window, under a scorer's rule="kvpress")
                    # leaves the layer whole, as the -1 "not compressed" marker this replaced did
                    rc.append(bp + w), rf.append(max(floor, 0)), rz.append(floor >= 0)
                    if l < self.skip:
                        rb.append(bp + w)
                    else:
                        most = min(t - w, H * bp) * (1 - self.alpha) + floor
                        rb.append(min(t, w + math.ceil(most)))
            counts.append(rc), bound.append(rb), floors.append(rf), compressed.append(rz)
        data = AdaData(compressed=by_layer(compressed, bool), floor=by_layer(floors))
        return Allocation.from_rows(req.lengths, counts, bound, data)

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations, protect: int) -> jax.Array:
        L, B, H, C = cache.valid.shape
        data: AdaData = plan.alloc
        counts, floor = as_i32(plan.counts), as_i32(data.floor)
        lengths = as_i32(plan.lengths)
        compress = as_bool(data.compressed)
        valid, pos, prot = cache.valid, cache.pos, scored.protected & cache.valid
        s = scored.scores.astype(jnp.float32)
        flat = lambda x: x.reshape(L, B, H * C)  # noqa: E731  (head-major, so ties go to lower heads)
        if self.rule == "kvpress":
            n_kept, n_safe = counts, floor
            rest = valid & ~select(s, valid, n_safe[:, :, None], pos=pos, protected=prot)
            n_glob = H * (n_kept - n_safe)
            chosen = select(flat(s), flat(rest), n_glob, pos=flat(pos), protected=flat(prot))
            chosen = chosen.reshape(L, B, H, C).sum(-1)
            per_head = jnp.minimum(n_safe[..., None], valid.sum(-1)) + chosen
        else:
            cand = valid & ~prot
            bp = counts - protect  # B' per (layer, row)
            if self.normalize:
                s = s * _top_share(s, cand, bp)
            chosen = select(flat(s), flat(cand), H * bp, pos=flat(pos)).reshape(L, B, H, C).sum(-1)
            caps = jnp.round(chosen.astype(jnp.float32) * jnp.float32(1 - self.alpha) + floor[..., None])
            caps = caps.astype(jnp.int32)
            skipped = (jnp.arange(L) < self.skip)[:, None, None]
            caps = jnp.where(skipped, bp[..., None], caps)
            per_head = caps + prot.sum(-1)
        return jnp.where(compress[..., None], per_head, lengths[None, :, None]).astype(jnp.int32)


def _top_share(s: jax.Array, cand: jax.Array, bp: jax.Array) -> jax.Array:
    """Per head: (sum of the top-B' candidate scores) / (sum of all candidate scores), [L,B,H,1]."""
    desc = -jnp.sort(-jnp.where(cand, s, -jnp.inf), axis=-1)
    desc = jnp.where(jnp.isfinite(desc), desc, 0.0)
    csum = jnp.cumsum(desc, axis=-1)
    idx = jnp.clip(bp - 1, 0, s.shape[-1] - 1)[:, :, None, None]
    top = jnp.take_along_axis(csum, jnp.broadcast_to(idx, s.shape[:3] + (1,)), -1)
    top = jnp.where(bp[:, :, None, None] > 0, top, 0)
    total = csum[..., -1:]
    return top / jnp.where(total > 0, total, 1)


# ----------------------------------------------------------------------------- global (DefensiveKV, KVzip)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Global(Allocator):
    """One budget shared by all KV heads of a layer (Ada-KV-style head budgets without a floor), or
    by all layers and heads (across_layers=True): each head's protected slots (from the scorer) are
    kept and the rest goes to the best scores across the group (DefensiveKV, Layer-DefensiveKV,
    KVzip). With S = Hkv (or Hkv * L) slots-per-token, the group keeps S * C entries for a budget C,
    and for a ratio r int(T (1 - r) S) (rounding="kept", DefensiveKV's code) or
    T S - int(T S r) (rounding="pruned", KVzip's code). A per-head budget at or below the
    protected count keeps the most recent protected slots."""

    across_layers: bool = False
    rounding: str = "kept"

    def __post_init__(self) -> None:
        if not isinstance(self.across_layers, bool):
            raise TypeError(f"across_layers must be a bool, got {self.across_layers!r}")
        check_choice("rounding", self.rounding, ("kept", "pruned"))

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        w, H, L, ratio = protect, req.num_kv_heads, req.num_layers, req.ratio
        counts, bound, totals, compressed = [], [], [], []
        for t, c in zip(req.lengths, req.row_budgets(compat)):
            n_kept = min(c, t)
            scale = H * (L if self.across_layers else 1)
            if ratio is None:
                total = scale * c
            elif self.rounding == "kept":
                total = int(t * (1 - ratio) * scale)
            else:
                total = scale * t - int(scale * t * ratio)
            if n_kept >= t:
                counts.append([t] * L), bound.append([t] * L), totals.append([0] * L), compressed.append([False] * L)
                continue
            most = t if self.across_layers else min(t, total - (H - 1) * min(w, n_kept))
            counts.append([n_kept] * L), bound.append([max(most, n_kept)] * L)
            totals.append([total] * L), compressed.append([True] * L)
        data = GlobalData(compressed=by_layer(compressed, bool), group_total=by_layer(totals))
        return Allocation.from_rows(req.lengths, counts, bound, data)

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations, protect: int) -> jax.Array:
        L, B, H, C = cache.valid.shape
        data: GlobalData = plan.alloc
        nominal, total, lengths = as_i32(plan.counts), as_i32(data.group_total), as_i32(plan.lengths)
        valid, prot = cache.valid, scored.protected & cache.valid
        forced = prot.sum(-1)  # [L,B,H]
        rest = valid & ~prot
        if self.across_layers:  # one selection per row over (layer, head, slot)
            flat = lambda x: jnp.moveaxis(x, 1, 0).reshape(B, L * H * C)  # noqa: E731
            left = total[0] - forced.sum((0, 2))  # [B]
            chosen = select(flat(scored.scores), flat(rest), left, pos=flat(cache.pos))
            chosen = jnp.moveaxis(chosen.reshape(B, L, H, C), 0, 1).sum(-1)
        else:
            flat = lambda x: x.reshape(L, B, H * C)  # noqa: E731
            left = total - forced.sum(-1)  # [L,B]
            chosen = select(flat(scored.scores), flat(rest), left, pos=flat(cache.pos)).reshape(L, B, H, C).sum(-1)
        counts = jnp.where((nominal <= protect)[..., None], nominal[..., None], forced + chosen)
        return jnp.where(as_bool(data.compressed)[..., None], counts, lengths[None, :, None]).astype(jnp.int32)



# ----------------------------------------------------------------------------- CAKE


def cake_statistics(
    obs: Observations, cache: KVCache, lengths: jax.Array, window: int, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """CAKE's per-layer statistics over A°, the window attention on non-window keys (§8).

    Returns (entropy H [L,B], variance V [L,B], mean_i A [L,B,Hkv,G,C], unbiased var_i A
    [L,B,Hkv,G,C], candidate mask [L,B,Hkv,C]). Statistics are per row (CAKE runs batch 1).
    """
    q, qp = last_window(obs, window)
    m = window_moments(q, qp, cache, scale=scale, group_reduce=None, moments=("sum", "sumsq", "entropy"))
    cand = cache.valid & (cache.pos < (lengths - window)[None, :, None, None])
    c5 = cand[:, :, :, None, :]
    mean = m["sum"] / window
    var = jnp.maximum((m["sumsq"] - m["sum"] * mean) / (window - 1), 0.0)
    ent = jnp.where(c5, m["entropy"], 0.0).sum((2, 3, 4))
    tot_var = jnp.where(c5, var, 0.0).sum((2, 3, 4))
    return ent, tot_var, mean, var, cand


def cake_log_preference(ent: jax.Array, var: jax.Array, tau1: float, tau2: float) -> jax.Array:
    """log P_l = log H_l / tau1 + log V_l / tau2 (log space avoids fp32 overflow), [L,B]."""
    return jnp.log(ent) / tau1 + jnp.log(var) / tau2


def cake_adjust_budgets(raw: jax.Array, total: jax.Array, bound: jax.Array) -> jax.Array:
    """cakekv's `adjust_budgets`, vectorised over rows: raw [L,B] float, total [B], bound [B] -> [L,B].

    Truncate; clip to `bound`, spreading the excess over unclipped layers (remainder to the first);
    then force the sum to `total` over layers below the bound (adding) or above 1 (removing).
    """
    b = jnp.floor(raw).astype(jnp.int32)
    bound = bound[None, :]

    def spread(b, amount, ok):
        n_ok = ok.sum(0)
        safe = jnp.maximum(n_ok, 1)
        first = ok & (jnp.cumsum(ok, 0) <= (amount % safe)[None])
        return jnp.where((n_ok > 0)[None], ok * (amount // safe)[None] + first, 0)

    excess = jnp.maximum(b - bound, 0).sum(0)
    b = jnp.minimum(b, bound)
    b = b + jnp.where((excess > 0)[None], spread(b, excess, b < bound), 0)
    diff = total - b.sum(0)
    ok = jnp.where((diff > 0)[None], b < bound, b > 1)
    return b + jnp.sign(diff)[None] * spread(b, jnp.abs(diff), ok)


CAKE_PREFERENCES = ("window", "scorer")  # where Cake's layer preference P_l is measured


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cake(Allocator):
    """CAKE's layer budgets from the layer preference P_l = H_l^(1/tau1) * V_l^(1/tau2) (§8).

    With C the average budget and w the protected window: no eviction when T <= C + w; else the
    total (C - w)*L is split by P_l, fixed up by `adjust_budgets` and clipped. parity=True clips
    at T - w (the original, no memory saved); parity=False clips at min(T - w, cap_factor*(C - w))
    so that the cache compacts [kvjax choice]. Statistics use the last `window` queries.
    cascade=True is cakekv's `--cascading` mode: after each layer l the budgets of layers 0..l are
    recomputed from their preferences alone (the share P_m / sum_{k<=l} P_k of the whole total,
    fixed up over those layers) and each of them is re-evicted from its stored indicator; as the
    re-evictions are nested top-k of one score, layer m finally keeps min over l >= m of b_{m,l}.
    preference="window" measures H_l and V_l on the last `window` prompt queries (recorded for it, unless
    the scorer hands over P_l from those same queries, as CAKE does); preference="scorer" takes P_l from
    the scorer's own attention statistics (`Scored.layer_log_pref`, e.g. LookaheadKV's tokens, with this
    allocator's taus), records no window, and refuses a scorer that supplies none.
    """

    tau1: float = 1.0
    tau2: float = 1.0
    window: int = 32
    cap_factor: int = 2
    parity: bool = False
    cascade: bool = False
    preference: str = "window"

    def __post_init__(self) -> None:
        check_float("tau1", self.tau1, 0.0, math.inf, lo_open=True, hi_open=True)
        check_float("tau2", self.tau2, 0.0, math.inf, lo_open=True, hi_open=True)
        check_int("window", self.window, 2)
        check_int("cap_factor", self.cap_factor, 1)
        if not isinstance(self.parity, bool):
            raise TypeError(f"parity must be a bool, got {self.parity!r}")
        if not isinstance(self.cascade, bool):
            raise TypeError(f"cascade must be a bool, got {self.cascade!r}")
        check_choice("preference", self.preference, CAKE_PREFERENCES)

    def requirements(self) -> Requirements:
        if self.preference == "scorer":
            return Requirements()
        return Requirements(observe=ObservationSpec(window=self.window))

    def clip_bound(self, length: int, budget: int, protect: int) -> int:
        if self.parity:
            return length - protect
        return min(length - protect, self.cap_factor * (budget - protect))

    def allocate(self, req: PlanRequest, *, protect: int, compat: str) -> Allocation:
        L = req.num_layers
        counts, bound, clips, compressed = [], [], [], []
        for t, c in zip(req.lengths, req.row_budgets(compat)):
            if t <= c + protect:
                counts.append([t] * L), bound.append([t] * L), clips.append([0] * L), compressed.append([False] * L)
            else:
                clip = self.clip_bound(t, c, protect)
                counts.append([c] * L), bound.append([clip + protect] * L)
                # a negative clip (a budget below the window, under a scorer's rule="kvpress") leaves
                # the row whole, as the -1 "not compressed" marker this replaced did
                clips.append([max(clip, 0)] * L), compressed.append([clip >= 0] * L)
        data = CakeData(compressed=by_layer(compressed, bool), clip=by_layer(clips))
        return Allocation.from_rows(req.lengths, counts, bound, data)

    def layer_budgets(self, plan: Plan, log_pref: jax.Array, protect: int) -> jax.Array:
        """Non-window budget per (layer, row) [L,B] int32 before clipping (the cakekv b_l)."""
        L = log_pref.shape[0]
        # per-row constants (min/max over layers, in case a scorer left some layers whole)
        nominal, bound = as_i32(plan.counts).min(0), as_i32(plan.alloc.clip).max(0)
        total = (nominal - protect) * L
        lp = jnp.where(jnp.isnan(log_pref), -jnp.inf, log_pref)
        lp = jnp.where(jnp.isfinite(lp).any(0, keepdims=True), lp, 0.0)  # all-degenerate row: uniform
        if not self.cascade:
            share = jax.nn.softmax(lp, axis=0)
            return cake_adjust_budgets(share * total[None].astype(jnp.float32), total, bound)
        out = jnp.full(lp.shape, jnp.iinfo(jnp.int32).max, jnp.int32)
        for l in range(L):  # the state after layer l: budgets of the layers seen so far
            share = jax.nn.softmax(lp[: l + 1], axis=0)
            b = cake_adjust_budgets(share * total[None].astype(jnp.float32), total, bound)
            out = out.at[: l + 1].min(jnp.minimum(b, bound[None]))
        return out

    def head_counts(self, plan: Plan, scored: Scored, cache: KVCache, obs: Observations, protect: int) -> jax.Array:
        log_pref = scored.layer_log_pref
        if log_pref is None and self.preference == "scorer":
            raise ValueError("Cake(preference='scorer') needs a scorer that computes the layer preference "
                             "(Scored.layer_log_pref, as LookaheadKV does); this one returned none")
        if log_pref is None:
            lengths = as_i32(plan.lengths)
            scale = attention_scale(obs, cache.k.shape[-1], True)
            ent, var, *_ = cake_statistics(obs, cache, lengths, self.window, scale)
            log_pref = cake_log_preference(ent, var, self.tau1, self.tau2)
        return self.kept_from_budgets(plan, self.layer_budgets(plan, log_pref, protect), scored.protected, cache)

    def kept_from_budgets(self, plan: Plan, budgets: jax.Array, protected: jax.Array, cache: KVCache) -> jax.Array:
        data: CakeData = plan.alloc
        clip, lengths = as_i32(data.clip), as_i32(plan.lengths)
        kept = jnp.clip(budgets, 0, clip)[..., None] + (protected & cache.valid).sum(-1)
        return jnp.where(as_bool(data.compressed)[..., None], kept, lengths[None, :, None]).astype(jnp.int32)
