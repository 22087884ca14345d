"""Llama-family models: config, checkpoint loading and the functional forward."""

from kvjax.models.config import ModelConfig
from kvjax.models.llama import extend
from kvjax.models.model import Model, load_model

__all__ = ["Model", "ModelConfig", "extend", "load_model"]
