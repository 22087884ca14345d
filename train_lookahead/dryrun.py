"""Lower one train step for a config's mesh with abstract weights (no checkpoint, no memory).

    python -m train_lookahead --config configs/lookahead_llama31_8b_v5e.yaml --workdir /tmp/x --dry-run

The frozen params are `jax.ShapeDtypeStruct`s carrying the shardings of kvjax.sharding's logical
rules, the adapter, optimizer state and batch are abstract too, and `jax.jit(step).trace(...).lower()`
runs every shape and sharding check a real step would, so a bad mesh or batch fails on CPU
(with fake devices) instead of on the pod.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax.lookahead import init_adapter
from kvjax.models.config import ModelConfig
from kvjax.models.loading import param_shapes, param_shardings
from kvjax.models.model import Model
from kvjax.training import batch_shardings, build_step, init_state, make_optimizer

from train_lookahead.config import RunConfig
from train_lookahead.data import ROW_AXES
from train_lookahead.loss import lookahead_loss


def model_config(run: RunConfig) -> ModelConfig:
    """The ModelConfig of `model.architecture` (HF config.json fields) at `model.dtype`."""
    if run.model.architecture is None:
        raise ValueError("a dry run needs model.architecture (the model's HF config.json fields) in the config")
    return ModelConfig.from_hf(dict(run.model.architecture), run.model.dtype)


def abstract_params(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """The frozen params as ShapeDtypeStructs with their logical-rule shardings."""
    shardings = param_shardings(cfg, mesh)
    return jax.tree.map(lambda shape, s: jax.ShapeDtypeStruct(shape, cfg.jnp_dtype, sharding=s),
                        param_shapes(cfg), shardings, is_leaf=lambda x: isinstance(x, tuple))


def abstract_batch(run: RunConfig, cfg: ModelConfig, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch of `run`'s target mode, abstract, with its shardings."""
    B, T, Y = run.train.batch_size, run.data.max_prompt_tokens, run.targets.max_response_tokens
    shapes = {"tokens": ((B, T), jnp.int32), "positions": ((B, T), jnp.int32)}
    if run.targets.mode == "stored":
        shapes["target"] = ((cfg.num_global_layers, B, cfg.num_heads, T), jnp.float32)
    else:
        shapes.update(response=((B, Y), jnp.int32), response_positions=((B, Y), jnp.int32))
    s = batch_shardings(mesh, tuple(shapes), ROW_AXES)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=s[k]) for k, (shape, dtype) in shapes.items()}


def lower_train_step(run: RunConfig, cfg: ModelConfig, mesh: Mesh, steps: int = 1000) -> jax.stages.Lowered:
    """Lowers the real train step (kvjax.lookahead.loss_fn, AdamW) for `mesh` on abstract inputs."""
    if run.train.batch_size % mesh.shape["data"]:
        raise ValueError(f"train.batch_size={run.train.batch_size} must be divisible by mesh.data={mesh.shape['data']}")
    frozen = abstract_params(cfg, mesh)
    la = run.lookahead
    trainable = jax.eval_shape(
        lambda p: init_adapter(Model(config=cfg, params=p), la, jax.random.PRNGKey(0)).params, frozen)
    tx = make_optimizer(run.optim, steps)
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         jax.eval_shape(lambda t: init_state(t, tx), trainable))
    batch = abstract_batch(run, cfg, mesh)
    step = build_step(lookahead_loss(cfg, la, run.train.remat, run.train.loss, run.train.topk_fraction), tx, mesh, param_shardings(cfg, mesh), tuple(batch),
                      ROW_AXES)
    with jax.set_mesh(mesh):
        return step.trace(state, frozen, batch).lower()
