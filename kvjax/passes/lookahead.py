"""LookaheadKV's lookahead tokens: a pass in which the adapter's n learned tokens (LoRA on their rows)
attend to the prompt cache without being stored. The engine runs it riding the prefill (in each layer
right after the prompt's rows, reading the same weights: `riding_rows`), or after it (`produce`; an
ensemble, or a prefill shared with another adapter's policy); both give the same values.

The adapter's static configuration rides in the spec (`LookaheadTokens(config, model_info)`); its
params are the policy's traced inputs (`Policy.observation_inputs()`). An ensemble (`members` M > 1,
`kvjax.lookahead.stack`: params leaves [M, ...]) runs one pass per member, one after another, and its
fields are the members' mean.

Field: query_mass [L,B,Hq,C] float32: per query head, the tokens' attention mass over the cache slots,
summed over the n tokens (the softmax including their own causal keys). With `moments=True` (CAKE's
layer preference from the tokens' attention) also query_sumsq and query_entropy, the same shape
(`kvjax.observations.query_moments`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.lookahead import LookaheadConfig, ModelInfo, check_positions, lookahead_observations, lookahead_rows
from kvjax.models.config import ModelConfig
from kvjax.models.forward import RidingRows
from kvjax.observations.base import Observation


@dataclasses.dataclass(frozen=True)
class LookaheadTokens(Observation):
    config: LookaheadConfig
    model_info: ModelInfo
    moments: bool = False
    members: int = 1

    keyword = "lookahead"
    fields = ("query_mass", "query_sumsq", "query_entropy")
    producer = True

    def merge(self, other: Observation) -> LookaheadTokens:
        """One pass serves both when they run the same adapter; it records the moments if either asks."""
        if (self.config, self.model_info, self.members) != (other.config, other.model_info, other.members):
            return super().merge(other)  # raises
        return dataclasses.replace(self, moments=self.moments or other.moments)

    @classmethod
    def from_keyword(cls, value: Any) -> None:
        if value:
            raise TypeError("lookahead= takes a LookaheadTokens(config, model_info) observation (the adapter's)")
        return None

    def check(self, cfg: ModelConfig, longest: int, inputs: Any) -> None:
        self.model_info.check_matches(cfg)
        check_positions(cfg, longest, self.config)

    def rides_prefill(self) -> bool:
        """One adapter's tokens ride the prefill (an ensemble's members run one pass each, after it)."""
        return self.members == 1

    def riding_rows(self, cfg: ModelConfig, positions: jax.Array, inputs: Any) -> RidingRows:
        lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)
        return lookahead_rows(cfg, inputs, self.config, lengths, moments=self.moments)

    def produce(self, params: Any, cfg: ModelConfig, cache: KVCache, tokens: jax.Array, positions: jax.Array, *,
                rope_mode: str, inputs: Any) -> dict[str, jax.Array]:
        lengths = jnp.sum(positions >= 0, axis=-1).astype(jnp.int32)

        def one(member: Any) -> dict[str, jax.Array]:
            return lookahead_observations(params, cfg, member, self.config, cache, lengths, moments=self.moments)

        if self.members == 1:
            return one(inputs)
        return {k: v.mean(axis=0) for k, v in jax.lax.map(one, inputs).items()}
