"""The export folder: the adapter (kvjax.lookahead.save), the loss curve PNG and a card README.md."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure  # drawn without pyplot: the global backend is left alone

from kvjax.lookahead import Adapter, save
from train_lookahead.config import RunConfig

CURVE = "loss_curve.png"


def plot_loss(rows: Sequence[dict[str, float]], path: str | os.PathLike) -> None:
    """Training loss (KL) against step."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target || predicted)")
    ax.set_title("LookaheadKV training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_scores(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """A JSON object {name: score} (e.g. kvjax.eval results), or None."""
    if path is None:
        return None
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"export.eval_scores {str(path)!r}: no such file")
    scores = json.loads(path.read_text())
    if not isinstance(scores, dict):
        raise ValueError(f"export.eval_scores {str(path)!r}: expected a JSON object of name -> score")
    return scores


def card(cfg: RunConfig, *, command: str, model_path: str, steps: int, records: int, skipped: int,
         final_loss: float | None, scores: dict[str, Any] | None) -> str:
    """The model card text (markdown)."""
    la, o, t = cfg.lookahead, cfg.optim, cfg.train
    sources = "\n".join(f"- {_describe(s)}" for s in cfg.data.sources)
    lines = [
        "# LookaheadKV modules",
        "",
        f"Learned lookahead tokens and lookahead-only LoRA (arXiv 2603.10899) for the frozen model `{model_path}`,",
        "trained with kvjax's `train_lookahead` to predict "
        + ("the model's own response->prompt attention." if cfg.targets.teacher == "response"
           else "KVzip's reconstruction scores (targets.teacher: kvzip)."),
        "Load with `kvjax.lookahead.load(<this folder>)`.",
        "",
        "## Command",
        "",
        f"```bash\n{command}\n```",
        "",
        "The full run configuration is in `train_config.json`.",
        "",
        "## Data",
        "",
        sources,
        "",
        f"{records} prompts of at most {cfg.data.max_prompt_tokens} tokens (skipped as longer: {skipped}); "
        + (f"targets from the frozen model's greedy response of at most {cfg.targets.max_response_tokens} tokens "
         if cfg.targets.teacher == "response" else
         "targets: KVzip's scores of each prompt (the most attention each entry gets while the model repeats "
         "the prompt; no response generated) ")
        + f"(targets.mode: {cfg.targets.mode}).",
        "",
        "## Training",
        "",
        f"- modules: n_tokens={la.n_tokens}, LoRA rank={la.rank}, alpha={la.alpha:g} on {', '.join(la.projections)}",
        f"- steps: {steps}, batch {t.batch_size}, seed {t.seed}"
        + (f" (batch order; initialisation: seed {t.init_seed})" if t.init_seed is not None else "")
        + (f"; lookahead tokens start from the embeddings of ids {list(t.init_tokens)}" if t.init_tokens else ""),
        f"- AdamW lr {o.learning_rate:g} (warmup {o.warmup_fraction:g}, cosine to {o.final_fraction:g}x), "
        f"betas ({o.b1:g}, {o.b2:g}), weight decay {o.weight_decay:g}, clip {o.clip_norm:g}",
        "- loss: forward KL(target || predicted) over prompt positions, mean over layers and query heads"
        + (f"; final {final_loss:.4f}" if final_loss is not None else ""),
        "",
        f"![loss curve]({CURVE})",
    ]
    if scores:
        lines += ["", "## Evaluation", "", "| metric | score |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, (int, float)) else f"| {k} | {v} |" for k, v in scores.items()]
    return "\n".join(lines) + "\n"


def _describe(s: Any) -> str:
    if s.kind == "synthetic":
        return (f"synthetic (kvjax.data {', '.join(s.tasks)}): {s.num_samples} prompts at {s.context_length} "
                f"tokens, seed {s.seed} (offset from the eval's)"
                + ("" if s.query_aware else "; contexts alone, as the question-agnostic protocol compresses them"))
    if s.kind == "hf":
        return f"Hugging Face dataset {s.name} ({s.subset or 'default'}, {s.split})"
    return f"{s.kind} file {pathlib.Path(s.path).name}"


def export(folder: str | os.PathLike, adapter: Adapter, cfg: RunConfig, *, rows: Sequence[dict[str, float]],
           command: str, model_path: str, steps: int, records: int, skipped: int) -> pathlib.Path:
    """Writes the adapter, loss_curve.png, README.md and the run's train_config.json to `folder`; returns it."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save(adapter, folder)
    (folder / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    if rows:
        plot_loss(rows, folder / CURVE)
    scores = load_scores(cfg.export.eval_scores)
    text = card(cfg, command=command, model_path=model_path, steps=steps, records=records, skipped=skipped,
                final_loss=rows[-1]["loss"] if rows else None, scores=scores)
    (folder / "README.md").write_text(text)
    return folder
