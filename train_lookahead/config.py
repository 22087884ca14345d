"""Typed run configuration (YAML -> nested frozen dataclasses); unknown keys are an error.

    model:     which frozen model (bundled | folder | Hub id | .gguf file) and its dtype
    lookahead: kvjax.lookahead.LookaheadConfig fields (n_tokens, rank, alpha, projections, ...)
    data:      prompt sources (synthetic | jsonl | parquet | hf), prompt length cap, chat template
    targets:   the frozen model's greedy response cap and the target-generation batch
    train:     steps, batch, seeds (batch order, initialisation), checkpoint and log intervals
    optim:     AdamW + warmup-cosine + global-norm clip (policies.md §11.4 defaults)
    mesh:      device mesh ("data", "model") sizes
    export:    eval scores to put in the card
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
import typing
from typing import Any

import yaml

from kvjax.lookahead import LOSSES, LookaheadConfig
from kvjax.training import OptimConfig

SOURCE_KINDS = ("synthetic", "jsonl", "parquet", "hf")
LONG_PROMPTS = ("skip", "error")
TARGET_DTYPES = ("float32", "float16")
TARGET_MODES = ("stored", "on_the_fly")
TARGET_TEACHERS = ("response", "kvzip", "answer")
MODEL_DTYPES = (None, "float32", "bfloat16")


def _choice(name: str, value: Any, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r}; accepted values: {', '.join(map(repr, accepted))}")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    path: str = "bundled"  # "bundled", a local folder, a Hub id, or a .gguf file
    dtype: str | None = None  # None: the checkpoint's own
    # HF config.json fields of the model: lets `--dry-run` lower a train step with abstract weights
    # (no download, no memory), e.g. for a pod config checked on a laptop
    architecture: dict[str, Any] | None = None

    def __post_init__(self):
        _choice("model.dtype", self.dtype, MODEL_DTYPES)


@dataclasses.dataclass(frozen=True)
class SourceSection:
    """One prompt source. synthetic: `tasks` (names or suites of kvjax.data) at `context_length`
    tokens, `num_samples` in all, task by task in turn; jsonl / parquet: a local `path` whose rows hold
    "prompt" (text), "messages" (chat turns) or "tokens" (ids); hf: dataset `name` (+ `subset`,
    `split`) with the same fields, online only. `num_samples` None takes every row of a file."""

    kind: str = "synthetic"
    tasks: tuple[str, ...] = ("default",)
    context_length: int = 1024
    num_samples: int | None = None
    seed: int = 0
    path: str | None = None
    name: str | None = None
    subset: str | None = None
    split: str = "train"
    # synthetic only: True renders each sample as the query-aware eval does (context, question, answer
    # prefix); False as the question-agnostic eval compresses it (the context alone, in the chat template's
    # user turn), for targets that need no question (`targets.teacher: kvzip`)
    query_aware: bool = True

    def __post_init__(self):
        _choice("kind", self.kind, SOURCE_KINDS)
        if not isinstance(self.query_aware, bool):
            raise ValueError(f"query_aware must be true or false, got {self.query_aware!r}")
        if not self.query_aware and self.kind != "synthetic":
            raise ValueError(f"query_aware: false applies to synthetic sources only (a {self.kind} source's "
                             "rows are used as they are)")
        if self.kind == "synthetic":
            if self.num_samples is None or self.num_samples < 1:
                raise ValueError(f"num_samples must be >= 1 for a synthetic source, got {self.num_samples}")
            if self.context_length < 16:
                raise ValueError(f"context_length must be >= 16, got {self.context_length}")
        if self.kind in ("jsonl", "parquet") and not self.path:
            raise ValueError(f"path is required for a {self.kind} source")
        if self.kind == "hf" and not self.name:
            raise ValueError("name (a Hugging Face dataset id) is required for an hf source")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


@dataclasses.dataclass(frozen=True)
class DataSection:
    sources: tuple[SourceSection, ...] = (SourceSection(num_samples=64),)
    max_prompt_tokens: int = 1024  # prompts are right-padded to this; longer ones follow long_prompts
    long_prompts: str = "skip"  # "skip" (counted and reported) or "error"
    chat_template: bool = True  # wrap "prompt" text in the tokenizer's chat template when it has one

    def __post_init__(self):
        if not self.sources:
            raise ValueError("data.sources must list at least one source")
        if self.max_prompt_tokens < 2:
            raise ValueError(f"data.max_prompt_tokens must be >= 2, got {self.max_prompt_tokens}")
        _choice("data.long_prompts", self.long_prompts, LONG_PROMPTS)


@dataclasses.dataclass(frozen=True)
class TargetsSection:
    """mode "stored": the target stage writes s_GT [L, Hq, T] per prompt and the train step reads it;
    "on_the_fly": the stage writes only the responses, and each train step computes s_GT from the
    same prompt prefill as the lookahead rows (policies.md §11.4's one-prefill design; no
    [L, Hq, T] records on disk, one extra response pass per step).

    prompt_cache (mode "stored" only): the stage also writes each prompt's frozen KV cache (keys and
    values of every layer, in the model's dtype), and a train step reads it instead of prefilling its
    prompts again: a step then runs only the lookahead rows, the same loss without the frozen forward
    pass over T tokens that dominates it. Disk: 2 x layers x kv_heads x head_dim x dtype bytes per
    prompt token (SmolLM2-135M in float32: 45 KiB, 94 MB per 2,048-token prompt)."""

    max_response_tokens: int = 512  # cap on the frozen model's greedy response
    batch_size: int = 8  # prompts per generation call (one target chunk)
    dtype: str = "float32"  # of stored targets
    mode: str = "stored"
    prompt_cache: bool = False
    teacher: str = "response"  # the greedy response; "kvzip" (KVzip's scores); "answer" (the reference answer)

    def __post_init__(self):
        _choice("targets.mode", self.mode, TARGET_MODES)
        _choice("targets.teacher", self.teacher, TARGET_TEACHERS)
        if self.teacher == "kvzip" and self.mode != "stored":
            raise ValueError(f"targets.teacher: {self.teacher} needs targets.mode: stored, got mode {self.mode!r} "
                             "(on the fly, the targets come from the response)")
        if self.prompt_cache and self.mode != "stored":
            raise ValueError(f"targets.prompt_cache: true needs targets.mode: stored, got mode {self.mode!r} "
                             "(on the fly, each step prefills its prompts for the response anyway)")
        _positive("targets.max_response_tokens", self.max_response_tokens)
        _positive("targets.batch_size", self.batch_size)
        _choice("targets.dtype", self.dtype, TARGET_DTYPES)


@dataclasses.dataclass(frozen=True)
class TrainSection:
    steps: int | None = None  # None: one epoch (records // batch_size)
    batch_size: int = 8
    seed: int = 0  # shuffle order, and adapter initialisation unless init_seed is set
    init_seed: int | None = None  # the adapter's initialisation alone (None: seed), to tell the two apart
    # the vocabulary ids whose embeddings start the lookahead tokens (n_tokens of them); None: drawn by the init seed
    init_tokens: tuple[int, ...] | None = None
    checkpoint_every: int = 50
    log_every: int = 10
    remat: bool = False  # rematerialise the lookahead pass's layers in the backward pass (long prompts)
    loss: str = "kl"  # "kl" (policies.md §11.4) or "topk": -log of the predicted mass on the target's top slots
    topk_fraction: float = 0.25  # the top slots' share of the prompt for loss "topk"
    # False: the lookahead tokens follow the context alone, where the question-agnostic protocol compresses
    # (before the question), and the loss covers the context's entries; the target is the same (the response
    # to the whole prompt), restricted to the context. Needs records that know their context (synthetic).
    query_aware: bool = True

    def __post_init__(self):
        _choice("train.loss", self.loss, LOSSES)
        if not isinstance(self.query_aware, bool):
            raise ValueError(f"train.query_aware must be true or false, got {self.query_aware!r}")
        if not 0.0 < self.topk_fraction <= 1.0:
            raise ValueError(f"train.topk_fraction must be in (0, 1], got {self.topk_fraction!r}")
        if self.steps is not None:
            _positive("train.steps", self.steps)
        if self.init_seed is not None and (not isinstance(self.init_seed, int) or self.init_seed < 0):
            raise ValueError(f"train.init_seed must be an integer >= 0 or null (null: train.seed), "
                             f"got {self.init_seed!r}")
        _positive("train.batch_size", self.batch_size)
        _positive("train.checkpoint_every", self.checkpoint_every)
        _positive("train.log_every", self.log_every)

    @property
    def adapter_seed(self) -> int:
        """The seed of the adapter's initialisation (`init_seed`, else `seed`)."""
        return self.seed if self.init_seed is None else self.init_seed


@dataclasses.dataclass(frozen=True)
class OptimSection(OptimConfig):
    """`kvjax.training.OptimConfig` (its fields, checks and optimizer) with policies.md §11.4's defaults."""

    learning_rate: float = 2e-4
    final_fraction: float = 0.0  # end of the cosine, as a fraction of learning_rate


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int | None = None  # None: every device not used by `model`
    model: int = 1

    def __post_init__(self):
        _positive("mesh.model", self.model)
        if self.data is not None:
            _positive("mesh.data", self.data)


@dataclasses.dataclass(frozen=True)
class ExportSection:
    eval_scores: str | None = None  # a JSON file of {name: score} put in the card


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelSection = ModelSection()
    lookahead: LookaheadConfig = LookaheadConfig()
    data: DataSection = DataSection()
    targets: TargetsSection = TargetsSection()
    train: TrainSection = TrainSection()
    optim: OptimSection = OptimSection()
    mesh: MeshSection = MeshSection()
    export: ExportSection = ExportSection()

    def __post_init__(self):
        tokens = self.train.init_tokens
        if tokens is not None and (len(tokens) != self.lookahead.n_tokens or any(t < 0 for t in tokens)):
            raise ValueError(f"train.init_tokens must list lookahead.n_tokens={self.lookahead.n_tokens} vocabulary "
                             f"ids >= 0, got {list(tokens)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        return _build(cls, d, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "RunConfig":
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config {str(path)!r}: no such file")
        d = yaml.safe_load(path.read_text()) or {}
        if not isinstance(d, dict):
            raise ValueError(f"config {str(path)!r}: expected a mapping at the top level, got {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


def _build(cls: type, d: Any, where: str) -> Any:
    if cls is LookaheadConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{where or 'lookahead'} must be a mapping, got {type(d).__name__}")
        return LookaheadConfig.from_dict(dict(d))
    if not isinstance(d, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) in {where or 'the config'}: {', '.join(map(repr, unknown))}; "
                         f"accepted keys: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _value(hints[name], value, f"{where}.{name}" if where else name) for name, value in d.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:
        if "[" in where:  # a list item's own checks name only its field
            raise ValueError(f"{where}.{e}") from None
        raise


def _value(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _value(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_value(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ValueError(f"{where} must be {tp.__name__}, got {value!r}")
    return value


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    return x
