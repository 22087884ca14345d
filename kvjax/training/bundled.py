"""Train the bundled default model on the synthetic tasks of the eval suite, then export it.

    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled
    python -m kvjax.training.bundled --config configs/bundled_model.yaml --workdir runs/bundled --export kvjax/assets/model

Each step draws one sequence length (cycling through `data.lengths`) and `batch_size` samples of
the suite's tasks, rendered exactly as the evaluation renders them (kvjax.eval.prompts); the loss
is next-token cross-entropy on the answer tokens (and the end-of-turn token). Re-running the same
command resumes from the last checkpoint in the workdir.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from kvjax.models.config import ModelConfig
from kvjax.models.export import init_params, save_hf
from kvjax.models.llama import extend
from kvjax.training.loop import OptimConfig, train

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "tokenizer"


def load_tokenizer(folder: pathlib.Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def model_config(spec: dict[str, Any], tokenizer) -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=len(tokenizer), dtype="float32", rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
        num_layers=spec["num_layers"], num_heads=spec["num_heads"], num_kv_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"], max_position_embeddings=spec["max_position_embeddings"],
        rope_theta=float(spec["rope_theta"]), tie_embeddings=bool(spec["tie_embeddings"]),
    )


def render(sample: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids as the evaluation feeds them, target ids = the task's canonical completion + end-of-turn)."""
    from kvjax.eval.prompts import build_prompt, encode_prompt
    from kvjax.eval.tasks.targets import completion

    context, question = encode_prompt(build_prompt(sample, tokenizer), tokenizer)
    answer = tokenizer.encode(completion(sample), add_special_tokens=False)
    return context + question, answer + [tokenizer.eos_token_id]


MAX_TARGETS = 64  # answer tokens scored per row (logits are computed only there)


class TaskBatches:
    """batches(step) -> tokens, positions [B, length]; target_index, targets, weights [B, MAX_TARGETS].

    A pure function of `step`. target_index[b, j] is the position whose logits predict targets[b, j].
    """

    def __init__(self, data: dict[str, Any], tokenizer):
        from kvjax.eval.prompts import chat_overhead
        from kvjax.eval.tasks import task_names

        self.lengths = list(data["lengths"])
        self.batch_size = int(data["batch_size"])
        self.seed = int(data["seed"])
        self.tokenizer = tokenizer
        self.overhead = chat_overhead(tokenizer)
        # tasks whose prompt fits each length (variable tracking needs ~768 tokens for its one-shot example)
        self.tasks = {n: [t for t in task_names(data["suite"]) if self._fits(t, n)] for n in self.lengths}
        if not all(self.tasks.values()):
            raise ValueError(f"no task of suite {data['suite']!r} fits lengths {self.lengths}")

    def _fits(self, task: str, length: int) -> bool:
        from kvjax.eval.tasks import generate_task

        try:
            generate_task(task, self.tokenizer, length, 1, seed=self.seed, overhead=self.overhead)
            return True
        except ValueError:
            return False

    def sample(self, step: int, i: int) -> tuple[list[int], list[int]]:
        from kvjax.eval.tasks import generate_task

        index = step * self.batch_size + i
        length = self.lengths[step % len(self.lengths)]
        tasks = self.tasks[length]
        task = tasks[index % len(tasks)]
        s = generate_task(task, self.tokenizer, length, 1, seed=self.seed + index, overhead=self.overhead)[0]
        return render(s, self.tokenizer)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        length = self.lengths[step % len(self.lengths)]
        B = self.batch_size
        tokens = np.full((B, length), self.tokenizer.pad_token_id, np.int32)
        positions = np.full((B, length), -1, np.int32)
        target_index = np.zeros((B, MAX_TARGETS), np.int32)
        targets = np.zeros((B, MAX_TARGETS), np.int32)
        weights = np.zeros((B, MAX_TARGETS), np.float32)
        for i in range(B):
            prompt, answer = self.sample(step, i)
            seq = prompt + answer
            if len(seq) > length or len(answer) > MAX_TARGETS:
                raise ValueError(f"sample of {len(seq)} tokens ({len(answer)} answer tokens) exceeds "
                                 f"length={length} / MAX_TARGETS={MAX_TARGETS}")
            n, a = len(seq), len(answer)
            tokens[i, :n] = seq
            positions[i, :n] = np.arange(n)
            target_index[i, :a] = np.arange(len(prompt) - 1, n - 1)  # each answer token from the one before
            targets[i, :a] = answer
            weights[i, :a] = 1.0
        return {"tokens": tokens, "positions": positions, "target_index": target_index, "targets": targets,
                "weights": weights}


def lm_loss(params, frozen, batch, *, cfg: ModelConfig):
    """Weighted next-token cross-entropy; metrics: answer-token accuracy."""
    logits, _, _ = extend(params, cfg, None, batch["tokens"], batch["positions"], fresh=True,
                          logit_index=batch["target_index"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == batch["targets"]) * w).sum() / denom
    return (nll * w).sum() / denom, {"answer_token_accuracy": acc}


def plot_loss(log_path: pathlib.Path, out_png: pathlib.Path) -> list[dict[str, float]]:
    """Plots loss and answer-token accuracy against step from a `log.jsonl`; returns its rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["loss"] for r in rows], label="answer loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (answer tokens)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["answer_token_accuracy"] for r in rows], color="tab:orange", label="answer-token accuracy")
    ax2.set_ylabel("accuracy")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return rows


def write_model_card(out: pathlib.Path, conf: dict[str, Any], cfg: ModelConfig, rows: list[dict[str, float]],
                     config_path: str) -> None:
    """MODEL_CARD.md beside the exported weights: architecture, command, data, steps, loss curve."""
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))
    last = rows[-1] if rows else {}
    text = f"""# kvjax bundled model

A small Llama-architecture model (GQA) trained from scratch by kvjax's own code on the synthetic
long-context tasks of the evaluation's default suite, so that `python -m kvjax.eval` runs offline.
It is a test instrument for KV-cache eviction, not a language model.

- architecture: {cfg.num_layers} layers, width {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads
  (head_dim {cfg.head_dim}), MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size} (byte-level BPE in this
  folder), tied embeddings, RoPE theta {cfg.rope_theta}, {cfg.max_position_embeddings} positions; {n_params:,} parameters
- data: generated on the fly by `kvjax.eval.tasks` (suite `{conf['data']['suite']}`: RULER needle tasks and
  variable tracking) at lengths {conf['data']['lengths']} tokens, batch {conf['data']['batch_size']}, seeds from
  {conf['data']['seed']} (disjoint from the evaluation's); loss on the answer tokens only
- optimisation: AdamW, peak LR {conf['optim']['learning_rate']}, warmup {conf['optim']['warmup_fraction']:.0%},
  cosine decay, clip {conf['optim']['clip_norm']}; {last.get('step', 0)} steps
- final training loss {last.get('loss', float('nan')):.4f}, answer-token accuracy {last.get('answer_token_accuracy', float('nan')):.3f}
- reproduce: `python -m kvjax.training.bundled --config {config_path} --workdir runs/bundled` (resumes
  when re-run), then `--export kvjax/assets/model`

![loss curve](loss_curve.png)

## Full-cache scores

Filled in from `python -m kvjax.eval --policies none` (see `eval/` at the repository root).
"""
    (out / "MODEL_CARD.md").write_text(text)


def _shapes(cfg: ModelConfig):
    from kvjax.models.loading import param_shapes

    return param_shapes(cfg)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bundled_model.yaml", help="training YAML (model, data, optim, train)")
    ap.add_argument("--workdir", default="runs/bundled", help="checkpoints and log.jsonl; rerun to resume")
    ap.add_argument("--steps", type=int, help="override optim.steps")
    ap.add_argument("--max-minutes", type=float, help="stop (with a checkpoint) after this long; rerun to resume")
    ap.add_argument("--export", help="write the trained model (HF format + tokenizer) to this folder and exit")
    args = ap.parse_args(argv)
    conf = yaml.safe_load(pathlib.Path(args.config).read_text())
    if args.steps:
        conf["optim"]["steps"] = args.steps
    tokenizer = load_tokenizer()
    cfg = model_config(conf["model"], tokenizer)
    params = init_params(cfg, jax.random.PRNGKey(conf["train"].get("init_seed", 0)))
    optim = OptimConfig(**conf["optim"])
    if args.export:
        from kvjax.checkpoint import Checkpointer
        from kvjax.training.loop import make_optimizer

        ckpt = Checkpointer(pathlib.Path(args.workdir) / "checkpoints")
        like = {"trainable": params, "opt_state": make_optimizer(optim).init(params), "step": jnp.int32(0)}
        state = ckpt.restore(like)
        out = save_hf(args.export, jax.device_get(state["trainable"]), cfg)
        tokenizer.save_pretrained(out)
        rows = plot_loss(pathlib.Path(args.workdir) / "log.jsonl", out / "loss_curve.png")
        write_model_card(out, conf, cfg, rows, args.config)
        print(f"exported step {int(state['step'])} to {out}")
        return
    batches = TaskBatches(conf["data"], tokenizer)
    loss = functools.partial(lm_loss, cfg=cfg)
    pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.workdir) / "config.json").write_text(json.dumps(conf, indent=2))
    _, steps = train(loss, params, None, batches, optim, args.workdir,
                     checkpoint_every=conf["train"]["checkpoint_every"], log_every=conf["train"]["log_every"],
                     max_seconds=None if args.max_minutes is None else args.max_minutes * 60)
    print(f"trained to step {steps} in {args.workdir}")


if __name__ == "__main__":
    main()
