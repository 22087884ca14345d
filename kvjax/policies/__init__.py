"""KV-cache eviction policies: frozen dataclasses of hyperparameters plus pure functions.

`available()` lists the preset names; `get(name, **overrides)` returns a configured policy.
The engine protocol (plan -> prefill_keep -> init_decode -> decode_update) is in `base`.
"""

from kvjax.policies.allocators import Ada, Allocator, Cake, Global, Pyramid, Uniform
from kvjax.policies.base import Plan, Policy, Requirements, select
from kvjax.policies.baseline import Random
from kvjax.policies.cake import CAKE
from kvjax.policies.critical import CriticalKV
from kvjax.policies.defensive import DefensiveKV
from kvjax.policies.expected import ExpectedAttention
from kvjax.policies.h2o import H2O, H2OPrefill
from kvjax.policies.knorm import KNorm
from kvjax.policies.kvzip import KVzip
from kvjax.policies.lazy import LazyEviction
from kvjax.policies.lookahead import (
    AdaLookaheadKV,
    CakeLookaheadKV,
    CriticalLookaheadKV,
    LayerLookaheadKV,
    LookaheadKV,
)
from kvjax.policies.registry import available, get, resolve
from kvjax.policies.snapkv import AdaPyramidKV, AdaSnapKV, PyramidKV, SnapKV
from kvjax.policies.streaming import StreamingLLM
from kvjax.policies.tova import TOVA

__all__ = [
    "CAKE",
    "H2O",
    "TOVA",
    "Ada",
    "AdaLookaheadKV",
    "AdaPyramidKV",
    "AdaSnapKV",
    "Allocator",
    "Cake",
    "CakeLookaheadKV",
    "CriticalKV",
    "CriticalLookaheadKV",
    "DefensiveKV",
    "ExpectedAttention",
    "Global",
    "H2OPrefill",
    "KNorm",
    "KVzip",
    "LayerLookaheadKV",
    "LazyEviction",
    "LookaheadKV",
    "Plan",
    "Policy",
    "Pyramid",
    "PyramidKV",
    "Random",
    "Requirements",
    "SnapKV",
    "StreamingLLM",
    "Uniform",
    "available",
    "get",
    "resolve",
    "select",
]
