"""`Adapter`: LookaheadKV's learned embeddings and LoRA factors, their init, save and load.

Params pytree (float32, L layers, E hidden, r rank):
  embeddings [n, E]
  lora: {proj: {"a": [L, in, r], "b": [L, r, out]}} for proj in config.projections
(in, out) per projection: q (E, Hq*D), k and v (E, Hkv*D), o (Hq*D, E), gate and up (E, F), down (F, E).
An ensemble (`stack`, members M > 1) holds M such pytrees stacked on a leading axis: every leaf [M, ...].
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.lookahead.config import TRAINED_FIELDS, LookaheadConfig
from kvjax.models.config import ModelConfig

BUNDLED = pathlib.Path(__file__).resolve().parents[1] / "assets" / "lookahead"
WEIGHTS = "adapter.safetensors"
CONFIG = "adapter_config.json"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The dimensions of the model an adapter belongs to (for shape-mismatch errors)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelInfo:
        return cls(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.vocab_size, cfg.intermediate_size)

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(in, out) of a projection's weight."""
        E, F = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"q": (E, q), "k": (E, kv), "v": (E, kv), "o": (q, E), "gate": (E, F), "up": (E, F), "down": (F, E)}
        return shapes[proj]

    def check_matches(self, cfg: ModelConfig, what: str = "adapter") -> None:
        """ValueError naming every dimension where this differs from `cfg`'s model."""
        other = ModelInfo.of(cfg)
        diff = [f"{f.name}: {what} {getattr(self, f.name)} vs model {getattr(other, f.name)}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        if diff:
            raise ValueError(f"the LookaheadKV {what} was trained for another model ({'; '.join(diff)})")


@struct.dataclass
class Adapter:
    """LookaheadKV modules: `params` (a pytree, see the module doc) plus static `config` and `model_info`.

    members: 1, or M > 1 for an ensemble of M adapters of one recipe (`stack`; every params leaf [M, ...]):
    each member's tokens run their own lookahead pass and LookaheadKV scores the mean of their attention."""

    params: dict[str, Any]
    config: LookaheadConfig = struct.field(pytree_node=False)
    model_info: ModelInfo = struct.field(pytree_node=False)
    members: int = struct.field(pytree_node=False, default=1)

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError if this adapter was made for a model of other dimensions than `cfg`."""
        self.model_info.check_matches(cfg)


def expected_shapes(config: LookaheadConfig, info: ModelInfo, members: int = 1) -> dict[str, tuple[int, ...]]:
    """Flat name ("embeddings", "lora.q.a", ...) -> shape, for `config` on a model of `info` (an ensemble of
    `members` > 1: each shape with a leading members axis)."""
    shapes = {"embeddings": (config.n_tokens, info.hidden_size)}
    for p in config.projections:
        i, o = info.projection_shape(p)
        shapes[f"lora.{p}.a"] = (info.num_layers, i, config.rank)
        shapes[f"lora.{p}.b"] = (info.num_layers, config.rank, o)
    lead = (members,) if members > 1 else ()
    return {k: lead + v for k, v in shapes.items()}


def flatten(params: dict[str, Any]) -> dict[str, Any]:
    out = {"embeddings": params["embeddings"]}
    for p, f in params["lora"].items():
        out[f"lora.{p}.a"], out[f"lora.{p}.b"] = f["a"], f["b"]
    return out


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    lora: dict[str, dict[str, Any]] = {}
    for name, x in flat.items():
        if name.startswith("lora."):
            _, p, ab = name.split(".")
            lora.setdefault(p, {})[ab] = x
    return {"embeddings": flat["embeddings"], "lora": lora}


def _model_of(model: Any) -> tuple[dict[str, Any] | None, ModelConfig]:
    """(params or None, config) of a kvjax Model, or a bare ModelConfig."""
    if isinstance(model, ModelConfig):
        return None, model
    cfg = getattr(model, "config", None)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"model must be a kvjax.Model (or a ModelConfig), got {type(model).__name__}")
    return model.params, cfg


def init_adapter(model: Any, config: LookaheadConfig | None = None, key: jax.Array | None = None, *,
                 token_ids: Sequence[int] | None = None) -> Adapter:
    """Fresh modules (policies.md §11.4): LoRA A Kaiming-uniform over its input dimension
    (U(-1/sqrt(in), 1/sqrt(in)), the usual LoRA init), B = 0 (so training starts at the frozen
    model), and the embeddings copied from `n_tokens` distinct random vocabulary tokens, or from
    `token_ids` (n_tokens vocabulary ids) when given; `key` draws both (the ids only when not given)."""
    params, cfg = _model_of(model)
    if params is None:
        raise TypeError("init_adapter needs a kvjax.Model (its embedding table seeds the lookahead tokens)")
    config = LookaheadConfig() if config is None else config
    if not isinstance(config, LookaheadConfig):
        raise TypeError(f"config must be a LookaheadConfig, got {type(config).__name__}")
    key = jax.random.PRNGKey(0) if key is None else key
    info = ModelInfo.of(cfg)
    k_tok, *k_proj = jax.random.split(key, 1 + len(config.projections))
    n = config.n_tokens
    ids = jax.random.choice(k_tok, cfg.vocab_size, (n,), replace=n > cfg.vocab_size)
    if token_ids is not None:
        if len(token_ids) != n or not all(isinstance(t, (int, np.integer)) and 0 <= t < cfg.vocab_size
                                          for t in token_ids):
            raise ValueError(f"token_ids must be {n} (n_tokens) vocabulary ids in [0, {cfg.vocab_size}), "
                             f"got {list(token_ids)!r}")
        ids = jnp.asarray(token_ids, jnp.int32)
    lora = {}
    for k, p in zip(k_proj, config.projections):
        i, o = info.projection_shape(p)
        bound = 1.0 / np.sqrt(i)
        lora[p] = {"a": jax.random.uniform(k, (cfg.num_layers, i, config.rank), jnp.float32, -bound, bound),
                   "b": jnp.zeros((cfg.num_layers, config.rank, o), jnp.float32)}
    embeddings = jnp.asarray(params["embed"])[ids].astype(jnp.float32)
    return Adapter(params={"embeddings": embeddings, "lora": lora}, config=config, model_info=info)


def stack(adapters: Sequence[Adapter], config: LookaheadConfig | None = None) -> Adapter:
    """An ensemble of adapters of one recipe (the same model and trained fields, e.g. several training seeds):
    every params leaf stacked on a new leading axis, members = len(adapters). LookaheadKV runs each member's
    lookahead tokens in a pass of their own and scores the mean of their attention, which evens out how much
    one training run's ranking depends on its seed. Inference fields (pooling, tail, ...) are `config`'s, else
    the first adapter's. One adapter: itself (with `config`)."""
    adapters = list(adapters)
    if not adapters or not all(isinstance(a, Adapter) for a in adapters):
        raise TypeError("stack needs a non-empty sequence of Adapters")
    if any(a.members != 1 for a in adapters):
        raise ValueError("stack: an adapter is already an ensemble (members > 1); stack single adapters")
    first = adapters[0]
    config = first.config if config is None else config
    if not isinstance(config, LookaheadConfig):
        raise TypeError(f"config must be a LookaheadConfig, got {type(config).__name__}")
    for i, a in enumerate(adapters):
        if a.model_info != first.model_info:
            raise ValueError(f"stack: adapter {i} was trained for another model than adapter 0")
        diff = [f for f in TRAINED_FIELDS if getattr(a.config, f) != getattr(config, f)]
        if diff:
            raise ValueError(f"stack: adapter {i} differs in its trained fields {diff}; the members of an ensemble "
                             "share a recipe's n_tokens, span, rank, alpha and projections")
    if len(adapters) == 1:
        return first.replace(config=config)
    params = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[a.params for a in adapters])
    return Adapter(params=params, config=config, model_info=first.model_info, members=len(adapters))


def save(adapter: Adapter, folder: str | os.PathLike) -> pathlib.Path:
    """Writes `adapter.safetensors` (float32) and `adapter_config.json` into `folder`; returns it."""
    from safetensors.numpy import save_file

    if not isinstance(adapter, Adapter):
        raise TypeError(f"save needs an Adapter, got {type(adapter).__name__}")
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    flat = {k: np.asarray(jax.device_get(v), np.float32) for k, v in flatten(adapter.params).items()}
    save_file(flat, str(folder / WEIGHTS))
    meta = {"format": FORMAT, "config": adapter.config.to_dict(), "model": dataclasses.asdict(adapter.model_info)}
    if adapter.members > 1:
        meta["members"] = adapter.members
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def _missing_bundled() -> FileNotFoundError:
    return FileNotFoundError(
        f"no bundled LookaheadKV adapter at {BUNDLED} (the bundled model's adapter has not been trained "
        "yet). Pass one: kvjax.policies.LookaheadKV(adapter=kvjax.lookahead.load(PATH)), or "
        "`python -m kvjax.eval --lookahead PATH`, where PATH holds adapter.safetensors and adapter_config.json "
        "(written by kvjax.lookahead.save or the train_lookahead export)")


def load(path: str | os.PathLike = "bundled", model: Any = None) -> Adapter:
    """Reads an adapter written by `save`: a folder (or its adapter_config.json), or "bundled"
    (kvjax/assets/lookahead, the bundled model's adapter). With `model` (a kvjax.Model or a
    ModelConfig) the adapter must fit that model. Clear errors: missing folder or file
    (FileNotFoundError), corrupt file, unknown config keys, tensors of the wrong shape (ValueError)."""
    bundled = str(path) == "bundled"
    folder = BUNDLED if bundled else pathlib.Path(path).expanduser()
    if folder.is_file() and folder.name in (CONFIG, WEIGHTS):
        folder = folder.parent
    if not folder.is_dir():
        if bundled:
            raise _missing_bundled()
        raise FileNotFoundError(f"LookaheadKV adapter {str(path)!r}: no such folder")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            if bundled:
                raise _missing_bundled()
            raise FileNotFoundError(f"LookaheadKV adapter {folder}: missing {name} (expected {CONFIG} and {WEIGHTS})")
    try:
        meta = json.loads((folder / CONFIG).read_text())
        if not isinstance(meta, dict) or not {"config", "model"} <= set(meta):
            raise ValueError("it needs the keys 'config' and 'model'")
        info = ModelInfo(**meta["model"])
        members = meta.get("members", 1)
        if isinstance(members, bool) or not isinstance(members, int) or members < 1:
            raise ValueError(f"'members' must be an int >= 1, got {members!r}")
    except (ValueError, TypeError) as e:
        raise ValueError(f"corrupt LookaheadKV adapter config {folder / CONFIG}: {e}") from None
    if meta.get("format", FORMAT) != FORMAT:
        raise ValueError(f"LookaheadKV adapter {folder}: format {meta.get('format')!r}; "
                         f"this kvjax reads format {FORMAT}")
    config = LookaheadConfig.from_dict(meta["config"])
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        flat = load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt LookaheadKV adapter weights {folder / WEIGHTS}: {e}") from None
    want = expected_shapes(config, info, members)
    if set(flat) != set(want):
        raise ValueError(f"LookaheadKV adapter {folder / WEIGHTS}: tensors {sorted(flat)} do not match its config, "
                         f"which needs {sorted(want)}")
    bad = [f"{k} {tuple(flat[k].shape)} (expected {want[k]})" for k in sorted(want) if tuple(flat[k].shape) != want[k]]
    if bad:
        raise ValueError(f"LookaheadKV adapter {folder / WEIGHTS}: tensors of the wrong shape: {', '.join(bad)}")
    adapter = Adapter(params=unflatten({k: jnp.asarray(v, jnp.float32) for k, v in flat.items()}),
                      config=config, model_info=info, members=members)
    if model is not None:
        adapter.check_model(_model_of(model)[1])
    return adapter
