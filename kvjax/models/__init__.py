"""Llama-family models: config, checkpoint loading, the layer math (`llama`) and the forward (`forward.extend`)."""

from kvjax.models.config import ModelConfig
from kvjax.models.forward import RidingRows, extend
from kvjax.models.model import Model, load_model

__all__ = ["Model", "ModelConfig", "RidingRows", "extend", "load_model"]
