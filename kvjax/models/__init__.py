"""Llama-family models: config, checkpoint loading and the functional forward."""

from kvjax.models.config import ModelConfig
from kvjax.models.llama import Observe, extend
from kvjax.models.model import Model, load_model

__all__ = ["Model", "ModelConfig", "Observe", "extend", "load_model"]
