"""`LookaheadConfig`: the hyperparameters of a LookaheadKV adapter (policies.md §11.2-11.3)."""

from __future__ import annotations

import dataclasses
from typing import Any

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
# fixed by training; the other fields are read at inference
TRAINED_FIELDS = ("n_tokens", "span", "rank", "alpha", "projections")
GQA_REDUCES = ("mean", "max")
POOLINGS = ("max", None)


def _int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"LookaheadConfig.{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"LookaheadConfig.{name} must be an int >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """Static description of the learned lookahead tokens and their row-masked LoRA.

    n_tokens: learned embeddings appended after a prompt of T tokens.
    span: where they sit. None: right after the prompt, at positions T .. T+n-1; an int S >= n_tokens:
      spread evenly over the S positions an answer would take, token i at T + floor(i * S / n_tokens)
      (their attention then sees the prompt from the distances the answer's tokens will).
    rank, alpha: LoRA rank and alpha (the delta is scaled by alpha / rank).
    projections: the linear layers of every decoder layer that carry a LoRA, a subset of
      ("q", "k", "v", "o", "gate", "up", "down").
    gqa_reduce: "mean" or "max" over the query heads of a KV head (scores per KV head).
    bridge: before pooling, a slot with higher scores within `bridge` slots on both sides takes the lower of
      the two (`kvjax.policies.scoring.bridge1d`; two peaks up to bridge + 1 apart get the whole run between
      them filled): the lookahead tokens attend to a needle's key and to the end of its value but little to
      the value's inner tokens (a UUID's last 20 of 31), and bridging keeps the run between them. 0: off.
    pooling: "max" (kernel `kernel`, odd) or None, along the prompt positions.
    pool_offset: moves the pooling window back, 0 <= pool_offset <= kernel // 2: slot j takes the max over
      j - kernel//2 - pool_offset .. j + kernel//2 - pool_offset, so a strongly attended slot lends its score
      to the kernel//2 + pool_offset slots after it (the rest of a value an answer copies from there on)
      and to kernel//2 - pool_offset before it. 0: centred (SnapKV's pooling).
    tail, tail_weight: after pooling, each slot takes at least tail_weight x the highest (unpooled) score of
      the `tail` slots before it: the slots after a strongly attended one (the rest of a value that starts
      there) outrank weakly scored slots without outranking other peaks' neighbourhoods, as a wide forward
      window (pool_offset) would. tail 0: off.
    protect_last: the last prompt tokens always kept (0: none).
    window, window_weight: the prompt's own last `window` queries (SnapKV's observation window; in the
      query-aware protocol, the question and the answer prefix) score the prompt too: per query head,
      s̃ + window_weight x their mean attention, before the GQA reduction, bridging, pooling and tail; the
      `window` last slots are always kept. 0: off (the lookahead tokens alone).
    """

    n_tokens: int = 32
    span: int | None = None
    rank: int = 8
    alpha: float = 32.0
    projections: tuple[str, ...] = PROJECTIONS
    gqa_reduce: str = "mean"
    bridge: int = 0
    pooling: str | None = "max"
    kernel: int = 7
    pool_offset: int = 0
    tail: int = 0
    tail_weight: float = 0.5
    protect_last: int = 0
    window: int = 0
    window_weight: float = 1.0

    def __post_init__(self) -> None:
        _int("n_tokens", self.n_tokens, 1)
        if self.span is not None:
            _int("span", self.span, self.n_tokens)
        _int("rank", self.rank, 1)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LookaheadConfig.alpha must be a positive float, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.projections, str) or not isinstance(self.projections, (tuple, list)):
            raise TypeError(f"LookaheadConfig.projections must be a tuple of names from {PROJECTIONS}, "
                            f"got {self.projections!r}")
        bad = [p for p in self.projections if p not in PROJECTIONS]
        if bad or len(set(self.projections)) != len(self.projections):
            raise ValueError(f"LookaheadConfig.projections must be distinct names from {PROJECTIONS}, "
                             f"got {tuple(self.projections)!r}")
        object.__setattr__(self, "projections", tuple(self.projections))
        if self.gqa_reduce not in GQA_REDUCES:
            raise ValueError(f"LookaheadConfig.gqa_reduce must be one of {GQA_REDUCES}, got {self.gqa_reduce!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"LookaheadConfig.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        _int("bridge", self.bridge, 0)
        _int("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise ValueError(f"LookaheadConfig.kernel must be odd (same-padding pooling), got {self.kernel}")
        _int("pool_offset", self.pool_offset, 0)
        if self.pool_offset > self.kernel // 2:
            raise ValueError(f"LookaheadConfig.pool_offset must be in [0, kernel // 2 = {self.kernel // 2}] (the "
                             f"window keeps its own slot), got {self.pool_offset}")
        _int("tail", self.tail, 0)
        if isinstance(self.tail_weight, bool) or not isinstance(self.tail_weight, (int, float)) or \
                not 0 < self.tail_weight <= 1:
            raise ValueError(f"LookaheadConfig.tail_weight must be a float in (0, 1], got {self.tail_weight!r}")
        object.__setattr__(self, "tail_weight", float(self.tail_weight))
        _int("protect_last", self.protect_last, 0)
        _int("window", self.window, 0)
        if isinstance(self.window_weight, bool) or not isinstance(self.window_weight, (int, float)) or \
                not self.window_weight > 0:
            raise ValueError(f"LookaheadConfig.window_weight must be a positive float, got {self.window_weight!r}")
        object.__setattr__(self, "window_weight", float(self.window_weight))

    @property
    def protected(self) -> int:
        """The last prompt slots always kept: protect_last, or the observation window when wider."""
        return max(self.protect_last, self.window)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The lookahead tokens' positions after the prompt: token i sits at T + offsets[i]."""
        if self.span is None:
            return tuple(range(self.n_tokens))
        return tuple(i * self.span // self.n_tokens for i in range(self.n_tokens))

    @property
    def scale(self) -> float:
        """The LoRA scale alpha / rank."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["projections"] = list(self.projections)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LookaheadConfig:
        """The config of a JSON dict; unknown keys raise ValueError naming them."""
        if not isinstance(d, dict):
            raise TypeError(f"LookaheadConfig.from_dict needs a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"LookaheadConfig: unknown key(s) {unknown}; accepted: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("projections"), list):
            d["projections"] = tuple(d["projections"])
        return cls(**d)
