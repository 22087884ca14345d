"""kvjax: KV-cache eviction for long-context LLM inference in JAX."""

from kvjax.cache import KVCache
from kvjax.compilation_cache import enable_compilation_cache
from kvjax.engine import GenerateOutput, generate
from kvjax.models import Model, ModelConfig, load_model
from kvjax.sharding import make_mesh
from kvjax import lookahead, policies

__all__ = ["GenerateOutput", "KVCache", "Model", "ModelConfig", "enable_compilation_cache", "generate", "load_model",
           "lookahead", "make_mesh", "policies"]
__version__ = "0.1.0"
