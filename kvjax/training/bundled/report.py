"""The exported bundled model's report: loss curve and MODEL_CARD.md (architecture, data, phases, scores)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

from kvjax.models.config import ModelConfig
from kvjax.models.loading import param_shapes
from kvjax.training.bundled.config import BundledConfig, load_config


def plot_loss(logs: list[tuple[pathlib.Path, int]], out_png: pathlib.Path) -> list[dict[str, float]]:
    """Plots loss and answer-token accuracy against step from `log.jsonl` files, each with the step
    its run started from (phases of one training, in order); returns the rows, steps offset."""
    from matplotlib.figure import Figure  # drawn without pyplot: the global backend is left alone

    rows = [{**row, "step": row["step"] + offset} for path, offset in logs
            for row in map(json.loads, filter(str.strip, path.read_text().splitlines()))]
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(steps, [r.get("answer_loss", r["loss"]) for r in rows], label="answer loss")
    if any("context_loss" in r for r in rows):
        ax.plot(steps, [r.get("context_loss", float("nan")) for r in rows], label="prompt-token loss", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["answer_token_accuracy"] for r in rows], color="tab:green", label="answer-token accuracy",
             alpha=0.8)
    ax2.set_ylabel("accuracy")
    for _, offset in logs[1:]:  # where a phase starts
        ax.axvline(offset, color="gray", linestyle="--", linewidth=0.8)
    fig.legend(loc="upper center", ncol=3, fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return rows


def write_model_card(out: pathlib.Path, conf: BundledConfig, cfg: ModelConfig, rows: list[dict[str, float]],
                     config_path: str, scores: dict[str, Any] | None = None,
                     earlier: dict[str, Any] | None = None) -> None:
    """MODEL_CARD.md beside the exported weights: architecture, command, data, steps, loss curve."""
    optim, data, recall, more = conf.optim, conf.data, conf.data.recall, conf.data.more_recall
    curriculum = "; ".join(f"{list(c.lengths)} (batch {c.batch_size}) until step {c.until}" for c in data.curriculum)
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    last = rows[-1] if rows else {}
    text = f"""# kvjax bundled model

A small Llama-architecture model (GQA) trained from scratch by kvjax's own code on the synthetic
long-context tasks of the evaluation's default suite, so that `python -m kvjax.eval` runs offline.
It is a test instrument for KV-cache eviction, not a language model.

- architecture: {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads
  (head_dim {cfg.head_dim}), MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size} (byte-level BPE in this
  folder), tied embeddings, RoPE theta {cfg.rope_theta}, {cfg.max_position_embeddings} positions; {n_params:,} parameters
- data: generated on the fly by `kvjax.eval.tasks` (suite `{data.suite}`: RULER needle tasks and
  variable tracking), rendered with the chat template exactly as the evaluation renders them, at row lengths
  {list(data.lengths)} tokens{f" (first {curriculum})" if curriculum else ""}, batch {data.batch_size}, seeds from
  {data.seed} (disjoint from the evaluation's), task weights {data.task_weights}
  (the last phase's data; each phase's config says what it changed).
  After its answer, each row holds further user turns asking about the other needles of its context
  (up to {data.drill_fraction:.0%} of the row; values of several keys listed in {data.drill_order} order),
  so one long context yields many retrieval targets.
  {data.copy_fraction:.0%} of rows instead ask to repeat a list of random values (numbers, UUIDs,
  keys, variable names), which grows copying (induction) heads; from step
  {recall.from_step}, a share of {recall.share:.0%}
  of those list needle lines and ask for every value again, as needle lines or as the evaluation's answer sentences
  ({recall.uuids:.0%} of them with UUID values; {recall.multi_value:.0%} of their keys with 2-4 values);
  from step {more.from_step}, a further
  {more.fraction:.0%} of the task rows are such recall rows{
  f"; vt rows hold {data.vt_chains} more chains, each asked about after the answer"
  if data.vt_chains else ""}
- loss: mean cross-entropy on the answer tokens + {conf.train.context_weight:g} x mean cross-entropy on
  every other prompt token (language modelling of the prompts)
- optimisation: AdamW, peak LR {optim.learning_rate}, warmup {optim.warmup_fraction:.0%}, cosine decay to
  {optim.final_fraction:.0%}, weight decay {optim.weight_decay}, clip {optim.clip_norm}; {last.get('step', 0)} steps in all
{_phases_table(config_path, conf, earlier)}
- final answer loss {last.get('answer_loss', last.get('loss', float('nan'))):.4f}, answer-token accuracy {last.get('answer_token_accuracy', float('nan')):.3f}
- reproduce: {_reproduce(config_path, earlier)}

![loss curve](loss_curve.png)

## Full-cache scores

{_scores_section(scores)}
"""
    (out / "MODEL_CARD.md").write_text(text)


def _phases_table(config_path: str, conf: BundledConfig, earlier: dict[str, Any] | None) -> str:
    """A Markdown table of the training phases: config, steps, peak learning rate, data seed."""
    rows = ["| phase | config | steps | peak LR | data seed |", "|---:|---|---:|---:|---:|"]
    phases = [(p["config"], load_config(p["config"])) for p in _chain(earlier)]
    for j, (path, c) in enumerate(phases + [(config_path, conf)], start=1):
        rows.append(f"| {j} | `{path}` | {c.optim.steps} | {c.optim.learning_rate} | {c.data.seed} |")
    return "\n" + "\n".join(rows) + "\n"


def _chain(earlier: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The earlier phases a run started from (its `init_from.json`, nested), oldest first."""
    phases = []
    while earlier:
        phases.insert(0, earlier)
        earlier = earlier.get("earlier")
    return phases


def _reproduce(config_path: str, earlier: dict[str, Any] | None) -> str:
    cmd = "python -m kvjax.training.bundled"
    phases = _chain(earlier)
    if not phases:
        return (f"`{cmd} --config {config_path} --workdir runs/bundled` (resumes when re-run), then the same "
                "command with `--export kvjax/assets/model`")
    dirs = ["runs/bundled"] + [f"runs/bundled_{j + 2}" for j in range(len(phases))]
    steps = [f"`{cmd} --config {phases[0]['config']} --workdir {dirs[0]}` ({phases[0]['step']} steps)"]
    for j, phase in enumerate(phases[1:] + [{"config": config_path}], start=1):
        init = f" --init-from {dirs[j - 1]} --init-from-config {phases[j - 1]['config']}"
        steps.append(f"`{cmd} --config {phase['config']} --workdir {dirs[j]}{init}`"
                     + (f" ({phase['step']} steps)" if "step" in phase else ""))
    return (", then ".join(steps) + " (each resumes when re-run), then the last command with "
            "`--export kvjax/assets/model`; the loss curve shows every phase")


def full_cache_scores(eval_dir: str | pathlib.Path) -> dict[str, Any]:
    """Mean full-cache score per task (0-100) from an eval output folder's results.jsonl, plus its run config."""
    folder = pathlib.Path(eval_dir)
    per_task: dict[str, list[float]] = {}
    for line in (folder / "results.jsonl").read_text().splitlines():
        if line.strip() and (row := json.loads(line))["policy"] == "full":
            per_task.setdefault(row["task"], []).append(float(row["score"]))
    config = json.loads((folder / "run_config.json").read_text())
    return {"tasks": {t: 100 * float(np.mean(v)) for t, v in per_task.items()},
            "samples": {t: len(v) for t, v in per_task.items()}, "config": config}


def _scores_section(scores: dict[str, Any] | None) -> str:
    if not scores:
        return "Not measured yet: run `python -m kvjax.eval` and export again with `--scores OUT_DIR`."
    cfg = scores["config"]
    lines = [f"From `python -m kvjax.eval` (context length {cfg['context_length']}, seed {cfg['seed']}, "
             f"{'query-aware' if cfg['query_aware'] else 'query-agnostic'}), full cache:", "",
             "| task | samples | score |", "|---|---|---|"]
    lines += [f"| {t} | {scores['samples'][t]} | {v:.1f} |" for t, v in scores["tasks"].items()]
    mean = float(np.mean(list(scores["tasks"].values())))
    lines += [f"| **mean** | | **{mean:.1f}** |"]
    return "\n".join(lines)


def _shapes(cfg: ModelConfig) -> Any:
    return param_shapes(cfg)

