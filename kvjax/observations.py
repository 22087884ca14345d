"""What a forward pass records for the eviction policies (DESIGN.md, "Observations a policy may ask for").

`ObservationSpec` is the one description of *what* to record: policies declare it (inside their
`Requirements`), the engine merges the specs of the policies that share a prefill, and the model's
`extend` records exactly that and returns it as `Observations`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
from flax import struct


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """KVzip's context-reconstruction pass (arXiv 2505.23416), run by the engine after the prefill.

    The prompt is cut into chunks of `chunk_size` tokens; chunk i is fed against the prefilled cache
    as [first_ids (i = 0) or next_ids + the last `postfix` tokens of chunk i-1 (i > 0), suffix_ids,
    chunk i], at positions T, T+1, ... Each key of chunk i scores the max, over the query heads of
    its group and over that pass's queries, of the softmax over the keys {sinks: positions <
    min(n_sink, chunk start)} + {chunk i} + {the pass's own keys, causal}; the pass's keys are then
    dropped (the prompt cache is unchanged).
    """

    chunk_size: int = 2048
    n_sink: int = 4
    postfix: int = 8
    first_ids: tuple[int, ...] = ()
    next_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ObservationSpec:
    """What `extend` records (static: part of the compiled shape).

    window: > 0 records the post-RoPE queries of the last `window` real tokens of the chunk.
    column_mass: records, per key, the attention mass all (valid, causal) queries put on it.
    step_probs: records the attention probabilities of the chunk's last query over the cache slots.
    output_norms: records, per key of a prefill, ||v_j W_o^h||_1 (the L1 norm of its value projected
      by its query head's rows of the output projection), averaged over the query group: the
      output-perturbation weight of CriticalKV and DefensiveKV (prefill only).
    query_stats: >= 0 records the mean and covariance of the pre-RoPE queries of the real prompt
      tokens at positions >= query_stats (ExpectedAttention's query statistics; -1 = none).
    reconstruction: a `Reconstruction` records, per prompt key, KVzip's max attention from the
      repeat-the-context pass (engine prefill only; None = not recorded).
    query_mass: records, per query head and cache slot, the attention probability summed over the
      chunk's real queries.
    lookahead: asks the engine for a LookaheadKV pass after the prompt: the learned tokens of the
      policy's adapter (`Policy.lookahead_adapter()`, its params a traced input) run against the
      prompt cache without being stored, and their `query_mass` over the prompt slots is recorded.
      The prompt prefill itself ignores it.
    """

    window: int = 0
    column_mass: bool = False
    step_probs: bool = False
    output_norms: bool = False
    query_stats: int = -1
    reconstruction: Reconstruction | None = None
    query_mass: bool = False
    lookahead: bool = False

    def merge(self, other: "ObservationSpec") -> "ObservationSpec":
        """What both need: the wider window, and every recorded quantity of either. Query
        statistics over different position ranges cannot share one prefill (ValueError)."""
        qs = max(self.query_stats, other.query_stats)
        if min(self.query_stats, other.query_stats) >= 0 and self.query_stats != other.query_stats:
            raise ValueError(
                f"query_stats: one prefill records query statistics from one position only, got "
                f"{self.query_stats} and {other.query_stats} (run these policies in separate calls)"
            )
        rec = self.reconstruction or other.reconstruction
        if None not in (self.reconstruction, other.reconstruction) and self.reconstruction != other.reconstruction:
            raise ValueError(
                f"reconstruction: one prefill runs one reconstruction pass, got {self.reconstruction} and "
                f"{other.reconstruction} (run these policies in separate calls)"
            )
        return ObservationSpec(
            window=max(self.window, other.window),
            column_mass=self.column_mass or other.column_mass,
            step_probs=self.step_probs or other.step_probs,
            output_norms=self.output_norms or other.output_norms,
            query_stats=qs,
            reconstruction=rec,
            query_mass=self.query_mass or other.query_mass,
            lookahead=self.lookahead or other.lookahead,
        )

    @classmethod
    def union(cls, specs: Iterable["ObservationSpec"]) -> "ObservationSpec":
        out = cls()
        for spec in specs:
            out = out.merge(spec)
        return out

    def __bool__(self) -> bool:
        return bool(self.window or self.column_mass or self.step_probs or self.query_mass or self.lookahead
                    or self.output_norms or self.query_stats >= 0 or self.reconstruction is not None)


@struct.dataclass
class Observations:
    """What `extend` recorded (absent observations are None).

    window_queries [L,B,Hq,w,D]: post-RoPE queries of the last w real tokens of each row;
    window_positions [B,w] int32: their absolute positions (-1 where a row has fewer than w tokens);
    column_mass [L,B,Hkv,C] float32: attention mass that all causal queries put on each slot
      (summed over the query group);
    step_probs [L,B,Hkv,G,C] float32: the last query's attention probabilities over the slots;
    query_mass [L,B,Hq,C] float32: per query head, the attention probability the chunk's real
      queries put on each cache slot, summed over them (after a LookaheadKV pass: its n learned
      tokens' mass over the prompt slots, the softmax including their own causal keys);
    lengths [B] int32: real tokens per row in the chunk (the prompt lengths, for a prefill);
    attn_scale: the model's softmax scale (static), for scorers that use the model's own scale.
    output_norms [L,B,Hkv,C] float32: group mean of ||v_j W_o^h||_1 per prompt slot (0 elsewhere);
    query_mean [L,B,Hq,D], query_cov [L,B,Hq,D,D] float32: mean and (biased, 1/n) covariance of the
      pre-RoPE queries at positions >= spec.query_stats of each row;
    rope_inv_freq: the model's RoPE inverse frequencies [D/2] (static tuple), with query statistics,
      so that a policy can rotate them to future positions without calling the model.
    reconstruction [L,B,Hkv,C] float32: KVzip's per-key max attention from the reconstruction pass
      (0 for slots no pass scored).
    """

    window_queries: jax.Array | None = None
    window_positions: jax.Array | None = None
    column_mass: jax.Array | None = None
    step_probs: jax.Array | None = None
    query_mass: jax.Array | None = None
    lengths: jax.Array | None = None
    attn_scale: float | None = struct.field(pytree_node=False, default=None)
    output_norms: jax.Array | None = None
    query_mean: jax.Array | None = None
    query_cov: jax.Array | None = None
    rope_inv_freq: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)
    reconstruction: jax.Array | None = None

    def restrict(self, spec: ObservationSpec) -> "Observations":
        """The observations a narrower `spec` asks for: the window cut to its last `spec.window`
        queries, and quantities it does not ask for dropped."""
        w = spec.window
        q, p = self.window_queries, self.window_positions
        if q is not None and q.shape[3] != w:
            if w > q.shape[3]:
                raise ValueError(f"observations hold a window of {q.shape[3]} queries; {w} were asked for")
            q, p = (q[:, :, :, q.shape[3] - w:], p[:, p.shape[1] - w:]) if w else (None, None)
        return self.replace(window_queries=q, window_positions=p,
                            column_mass=self.column_mass if spec.column_mass else None,
                            step_probs=self.step_probs if spec.step_probs else None,
                            query_mass=self.query_mass if spec.query_mass or spec.lookahead else None,
                            output_norms=self.output_norms if spec.output_norms else None,
                            query_mean=self.query_mean if spec.query_stats >= 0 else None,
                            query_cov=self.query_cov if spec.query_stats >= 0 else None,
                            reconstruction=self.reconstruction if spec.reconstruction is not None else None)
