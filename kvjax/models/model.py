"""`Model`: a loaded checkpoint (config + params + optional tokenizer), and `load_model`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax

from kvjax.models.config import SUPPORTED_DTYPES, ModelConfig
from kvjax.models.loading import load_params, to_device

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A Llama-family (or Gemma 2 / 3) model ready for `kvjax.generate`.

    config: static hyperparameters; params: the weights pytree (see kvjax.models.llama);
    tokenizer: a transformers tokenizer when the checkpoint folder has one, else None (token ids only);
    mesh: the device mesh the params are sharded over, or None for one device.
    """

    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Any = None
    path: str | None = None
    mesh: Any = None


def resolve_checkpoint(name_or_path: str | os.PathLike, *, revision: str | None = None, cache_dir: str | None = None) -> pathlib.Path:
    """A local folder as is; otherwise a Hub id, fetched with huggingface_hub or found in the local Hub cache."""
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model {name!r}: no such folder, and not a Hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    kwargs = dict(repo_id=name, revision=revision, cache_dir=cache_dir, allow_patterns=_HUB_PATTERNS)
    try:
        return pathlib.Path(snapshot_download(**kwargs))
    except Exception as online_error:  # offline, unknown repo, gated: fall back to the local cache
        try:
            return pathlib.Path(snapshot_download(**kwargs, local_files_only=True))
        except Exception:
            raise FileNotFoundError(
                f"model {name!r} is not a local folder, is not in the local Hub cache, and could not be "
                f"downloaded ({type(online_error).__name__}: {online_error})"
            ) from None


def load_tokenizer(folder: pathlib.Path) -> Any:
    """transformers' AutoTokenizer when the folder has tokenizer files, else None."""
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    tokenizer: bool = True,
) -> Model:
    """Loads a Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 (text) checkpoint from a local folder or a Hub id.

    dtype: "float32" or "bfloat16" (default: the checkpoint's torch_dtype).
    mesh: a ("data", "model") mesh from `kvjax.make_mesh`; params are sharded by logical-axis rules.
    """
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted values: {sorted(SUPPORTED_DTYPES)}")
    folder = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    cfg = ModelConfig.from_file(folder / "config.json", dtype)
    host = load_params(folder, cfg)
    shardings = None
    if mesh is not None:
        from kvjax.sharding import param_shardings

        shardings = param_shardings(cfg, mesh)
    params = to_device(host, shardings)
    tok = load_tokenizer(folder) if tokenizer else None
    return Model(config=cfg, params=params, tokenizer=tok, path=str(folder), mesh=mesh)
