"""`Model`: a loaded checkpoint (config + params + optional tokenizer), and `load_model`."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax

from kvjax.models.config import SUPPORTED_DTYPES, ModelConfig
from kvjax.models.gguf import is_gguf, load_gguf
from kvjax.models.loading import load_params, param_shardings, to_device
from kvjax.tokenizer import load_tokenizer as _load_tokenizer

BUNDLED = "bundled"
BUNDLED_MODEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "model"

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


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
    """A local folder (or `.gguf` file) as is; "bundled": the model shipped in the package (from any
    directory); otherwise a Hub id, fetched with huggingface_hub or found in the local Hub cache."""
    if str(name_or_path) == BUNDLED:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the bundled model is not in this installation ({BUNDLED_MODEL_DIR} has no config.json); "
                "pass a local folder, a .gguf file or a Hub id")
        return BUNDLED_MODEL_DIR
    path = pathlib.Path(name_or_path).expanduser()
    if is_gguf(path):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
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


def resolve_model(spec: str | None) -> str:
    """``bundled`` (or None) -> the model shipped in the package; a ``.gguf`` file or a folder as is;
    anything else is a Hub id (see `resolve_checkpoint`)."""
    if spec in (None, BUNDLED):
        return str(resolve_checkpoint(BUNDLED))
    return str(spec)


def load_tokenizer(folder: pathlib.Path) -> Any:
    """transformers' AutoTokenizer when the folder has tokenizer files, else None (`kvjax.tokenizer.load_tokenizer`)."""
    return _load_tokenizer(folder, required=False)


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    tokenizer: bool = True,
) -> Model:
    """Loads a Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3 (text) checkpoint from a local folder, a Hub id,
    a `.gguf` file (llama, qwen2, qwen3; quantized tensors are dequantized) or "bundled" (the model
    shipped in kvjax).

    dtype: "float32" or "bfloat16" (default: the checkpoint's torch_dtype; float32 for GGUF).
    mesh: a ("data", "model") mesh from `kvjax.make_mesh`; params are sharded by logical-axis rules.
    """
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted values: {sorted(SUPPORTED_DTYPES)}")
    folder = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    if folder.is_file():  # a GGUF file: weights, config and tokenizer in one
        cfg, host, tok = load_gguf(folder, dtype, tokenizer=tokenizer)
    else:
        cfg = ModelConfig.from_file(folder / "config.json", dtype)
        host = load_params(folder, cfg)
        tok = load_tokenizer(folder) if tokenizer else None
    shardings = None
    if mesh is not None:
        shardings = param_shardings(cfg, mesh)
    params = to_device(host, shardings)
    return Model(config=cfg, params=params, tokenizer=tok, path=str(folder), mesh=mesh)
