"""The bundled model's training config: frozen dataclasses parsed from the YAML (configs/bundled_model*.yaml).

Sections: ``model`` (`ModelSpec`), ``data`` (`DataConfig`), ``optim`` (`BundledOptim`: a
`kvjax.training.OptimConfig` and the run's ``steps``), ``train`` (`TrainConfig`). Unknown or missing
keys raise ValueError naming the section, the key and the accepted keys.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import yaml

from kvjax.models.config import ModelConfig
from kvjax.training.loop import OptimConfig

DRILL_ORDERS = ("query", "context")


def _fields(cls: type, raw: Any, where: str) -> dict[str, Any]:
    """``raw`` checked against the fields of dataclass ``cls``: a mapping, no unknown key, no missing one."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "raw"}
    if unknown := sorted(set(raw) - set(fields)):
        raise ValueError(f"unknown key(s) {unknown} in {where}; accepted keys: {sorted(fields)}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing := [n for n in required if n not in raw]:
        raise ValueError(f"missing key(s) {missing} in {where}; required keys: {required}")
    return dict(raw)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The architecture (vocabulary and special tokens come from the tokenizer)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    tie_embeddings: bool

    @classmethod
    def from_dict(cls, raw: Any, where: str = "model") -> ModelSpec:
        return cls(**_fields(cls, raw, where))


def model_config(spec: ModelSpec | Mapping[str, Any], tokenizer: Any) -> ModelConfig:
    """The float32 Llama `ModelConfig` of ``spec`` in ``tokenizer``'s vocabulary."""
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.from_dict(spec)
    return ModelConfig(
        family="llama", vocab_size=len(tokenizer), dtype="float32", rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=float(spec.rope_theta), tie_embeddings=bool(spec.tie_embeddings),
    )


@dataclasses.dataclass(frozen=True)
class Stage:
    """A curriculum stage: rows of ``lengths`` tokens, ``batch_size`` of them, before step ``until``."""

    until: int
    lengths: tuple[int, ...]
    batch_size: int


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """From ``from_step``, a ``share`` of the copy rows become recall rows; ``uuids``: share of those
    with UUID values (and keys); ``multi_value``: share of their keys with 2-4 values."""

    from_step: int = 0
    share: float = 0.0
    uuids: float = 0.0
    multi_value: float = 0.0

    @classmethod
    def from_dict(cls, raw: Any, where: str = "data.recall") -> RecallConfig:
        d = _fields(cls, raw, where)
        return cls(from_step=int(d.get("from_step", 0)), share=float(d.get("share", 0.0)),
                   uuids=float(d.get("uuids", 0.0)), multi_value=float(d.get("multi_value", 0.0)))


@dataclasses.dataclass(frozen=True)
class MoreRecallConfig:
    """From ``from_step``, this ``fraction`` of the remaining (task) rows become recall rows too."""

    from_step: int = 0
    fraction: float = 0.0

    @classmethod
    def from_dict(cls, raw: Any, where: str = "data.more_recall") -> MoreRecallConfig:
        d = _fields(cls, raw, where)
        return cls(from_step=int(d.get("from_step", 0)), fraction=float(d.get("fraction", 0.0)))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What `TaskBatches` draws (see its docstring); ``curriculum`` is parsed from
    ``[[until_step, lengths, batch_size?], ...]`` (batch_size defaults to ``batch_size``)."""

    suite: str
    lengths: tuple[int, ...]
    batch_size: int
    seed: int
    curriculum: tuple[Stage, ...] = ()
    drill_fraction: float = 0.0
    drill_order: str = "query"  # needle_drills' order of several keys' values
    copy_fraction: float = 0.0
    recall: RecallConfig = RecallConfig()
    more_recall: MoreRecallConfig = MoreRecallConfig()
    vt_chains: int = 0  # vt rows carry this many more chains, each asked about after the answer
    task_weights: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.drill_order not in DRILL_ORDERS:
            raise ValueError(f"drill_order must be 'query' or 'context', got {self.drill_order!r}")

    @classmethod
    def from_dict(cls, raw: Any, where: str = "data") -> DataConfig:
        d = _fields(cls, raw, where)
        batch_size = int(d["batch_size"])
        curriculum = []
        for c in d.get("curriculum", []):
            if not isinstance(c, (list, tuple)) or len(c) not in (2, 3):
                raise ValueError(f"{where}.curriculum entries must be [until_step, lengths] or "
                                 f"[until_step, lengths, batch_size], got {c!r}")
            curriculum.append(Stage(int(c[0]), tuple(c[1]), int(c[2]) if len(c) > 2 else batch_size))
        return cls(
            suite=d["suite"], lengths=tuple(d["lengths"]), batch_size=batch_size, seed=int(d["seed"]),
            curriculum=tuple(curriculum), drill_fraction=float(d.get("drill_fraction", 0.0)),
            drill_order=d.get("drill_order", "query"), copy_fraction=float(d.get("copy_fraction", 0.0)),
            recall=RecallConfig.from_dict(d.get("recall", {}), f"{where}.recall"),
            more_recall=MoreRecallConfig.from_dict(d.get("more_recall", {}), f"{where}.more_recall"),
            vt_chains=int(d.get("vt_chains", 0)),
            task_weights={t: int(w) for t, w in d.get("task_weights", {}).items()},
        )


@dataclasses.dataclass(frozen=True)
class BundledOptim(OptimConfig):
    """The ``optim`` section: `kvjax.training.OptimConfig` (its defaults are this recipe's) and ``steps``,
    the length of the run (and of its learning-rate schedule)."""

    steps: int = dataclasses.field(kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"optim.steps must be an int >= 1, got {self.steps!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    checkpoint_every: int
    log_every: int
    init_seed: int = 0
    context_weight: float = 0.0  # x the language-modelling loss on every other prompt token

    @classmethod
    def from_dict(cls, raw: Any, where: str = "train") -> TrainConfig:
        d = _fields(cls, raw, where)
        return cls(checkpoint_every=int(d["checkpoint_every"]), log_every=int(d["log_every"]),
                   init_seed=int(d.get("init_seed", 0)), context_weight=float(d.get("context_weight", 0.0)))


@dataclasses.dataclass(frozen=True)
class BundledConfig:
    """A whole training config; ``raw`` is the YAML mapping it was parsed from (written to the workdir)."""

    model: ModelSpec
    data: DataConfig
    optim: BundledOptim
    train: TrainConfig
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: Any) -> BundledConfig:
        d = _fields(cls, raw, "the config")
        return cls(model=ModelSpec.from_dict(d["model"]), data=DataConfig.from_dict(d["data"]),
                   optim=BundledOptim(**_fields(BundledOptim, d["optim"], "optim")),
                   train=TrainConfig.from_dict(d["train"]), raw=dict(raw))

    def with_steps(self, steps: int) -> BundledConfig:
        """This config with ``optim.steps`` replaced (in ``raw`` too)."""
        raw = {**self.raw, "optim": {**self.raw.get("optim", {}), "steps": steps}}
        return dataclasses.replace(self, optim=dataclasses.replace(self.optim, steps=steps), raw=raw)


def load_config(path: str | os.PathLike) -> BundledConfig:
    """The `BundledConfig` of a YAML file."""
    raw = yaml.safe_load(pathlib.Path(path).read_text())
    try:
        return BundledConfig.from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
