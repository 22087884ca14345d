"""The LookaheadKV recipe ablations on SmolLM2-135M-Instruct (issue 27), out of distribution.

Every variant changes one thing of `configs/lookahead_smollm2_ood.yaml` (the base: 32 tokens right after
the prompt, rank-8 LoRA on every projection, KL loss, 150 steps on 128 `ood_train` prompts, mean GQA
reduction, max pooling). A variant that keeps the base's model, data and targets sections shares the
base's targets (the frozen model's answers and their attention: the costly part); an eval-only variant
(GQA reduction, pooling: neither enters the loss) reuses the base's trained adapter with its config
changed. Each is then scored on RULER 2K question-agnostic at r = 0.5 and 0.75 (lookahead_kv only; the
full-cache rows are copied from the recorded agnostic run, same samples).

    python eval/lookahead_ablations/ablations.py run [--only NAME ...] [--runs DIR] [--train-only]   # resumes
    python eval/lookahead_ablations/ablations.py table > eval/lookahead_ablations/TABLE.md

`run` writes each variant's config to `configs/` here, trains it under `--runs` (default runs/lookahead_ablations;
the adapter weights stay there), copies its card, config, log and times to `adapters/NAME/` and writes its eval
to `results/NAME/`; `table` reads those.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import shutil
import subprocess
import sys
import time

import yaml

import kvjax.lookahead as lk
from kvjax.eval.paired import plus_minus, task_mean_se

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BASE = ROOT / "configs" / "lookahead_smollm2_ood.yaml"
FULL_ROWS = ROOT / "eval" / "smollm2_ruler_2k" / "agnostic" / "results.jsonl"
EVAL = ["--config", "configs/eval_smollm2_ruler_2k.yaml", "--policies", "lookahead_kv", "--compression-ratios",
        "0.5", "0.75", "--num-samples", "4", "--batch-size", "4", "--no-progress"]
SHARED = ("model", "data", "targets")  # sections that make the targets
# how every variant trains, not what: the targets stage stores each prompt's frozen KV cache and the train steps
# read it instead of prefilling again (the same loss, tests/lookahead_train/test_targets.py; from 2026-11-27 on,
# variants trained before it prefilled at every step, their train seconds say so)
ENGINEERING = {"targets": {"prompt_cache": True}}

# name: (what changes, overrides of the base config as {section: {key: value}}, eval_only). eval_only: False (trained),
# True (the base's adapter with inference-time fields changed), the name of the trained variant whose adapter it
# reuses that way, or a tuple of trained variants (same recipe, other seeds) whose adapters it scores as one ensemble
# (`kvjax.lookahead.stack`: the mean of their lookahead attention).
VARIANTS: dict[str, tuple[str, dict, bool | str | tuple[str, ...]]] = {
    "base": ("the base recipe", {}, False),
    "tokens_8": ("8 lookahead tokens", {"lookahead": {"n_tokens": 8}}, False),
    "tokens_16": ("16 lookahead tokens", {"lookahead": {"n_tokens": 16}}, False),
    "spread_128": ("tokens spread over the 128-token answer span", {"lookahead": {"span": 128}}, False),
    "rank_4": ("LoRA rank 4 (alpha 16)", {"lookahead": {"rank": 4, "alpha": 16.0}}, False),
    "rank_16": ("LoRA rank 16 (alpha 64)", {"lookahead": {"rank": 16, "alpha": 64.0}}, False),
    "attn_lora": ("LoRA on q, k, v, o only", {"lookahead": {"projections": ["q", "k", "v", "o"]}}, False),
    "steps_50": ("50 steps", {"train": {"steps": 50}}, False),
    "prompts_32": ("32 prompts (150 steps)", {"data": {"sources": [{"num_samples": 32}]}}, False),
    "loss_topk": ("ranking loss on the top 25%", {"train": {"loss": "topk", "topk_fraction": 0.25}}, False),
    "data_codes": ("data: + numbered records ending in codes (`ood_train_codes`)",
                   {"data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, False),
    "tokens_8_codes": ("8 lookahead tokens, data as data_codes",
                       {"lookahead": {"n_tokens": 8}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, False),
    "teacher_kvzip": ("teacher: KVzip's scores of the contexts alone (no response, no question)",
                      {"data": {"sources": [{"query_aware": False}]}, "targets": {"teacher": "kvzip"}}, False),
    "agnostic_train": ("tokens after the context alone (before the question), loss on its entries",
                       {"train": {"query_aware": False}}, False),
    "gqa_max": ("max over a KV head's query heads", {"lookahead": {"gqa_reduce": "max"}}, True),
    "no_pooling": ("no max pooling", {"lookahead": {"pooling": None}}, True),
    "kernel_3": ("max pooling over 3 positions (base: 7)", {"lookahead": {"kernel": 3}}, True),
    "kernel_15": ("max pooling over 15 positions (base: 7): a kept value's neighbours", {"lookahead": {"kernel": 15}},
                  True),
    "kernel_31": ("max pooling over 31 positions", {"lookahead": {"kernel": 31}}, True),
    "tokens_8_kernel_15": ("tokens_8's adapter, pooling over 15", {"lookahead": {"n_tokens": 8, "kernel": 15}},
                           "tokens_8"),
    "codes_kernel_15": ("data_codes' adapter, pooling over 15",
                        {"lookahead": {"kernel": 15}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                        "data_codes"),
    "tokens_8_codes_kernel_15": ("tokens_8_codes' adapter, pooling over 15",
                                 {"lookahead": {"n_tokens": 8, "kernel": 15},
                                  "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "tokens_8_codes"),
    "tokens_8_seed_1": ("tokens_8 with another training seed (init and batch order): its run-to-run spread",
                        {"lookahead": {"n_tokens": 8}, "train": {"seed": 1}}, False),
    "tokens_8_topk": ("8 lookahead tokens and the ranking loss on the top 25% (the two best trained changes)",
                      {"lookahead": {"n_tokens": 8}, "train": {"loss": "topk", "topk_fraction": 0.25}}, False),
    "tokens_8_topk_kernel_15": ("tokens_8_topk's adapter, pooling over 15",
                                {"lookahead": {"n_tokens": 8, "kernel": 15},
                                 "train": {"loss": "topk", "topk_fraction": 0.25}}, "tokens_8_topk"),
    # pooling that leans forward: a strongly attended slot lends its score to the slots after it, the rest of a
    # value the answer copies from there (a UUID is 31 SmolLM2 tokens; centred pooling kept its first ~17)
    "codes_after_15": ("data_codes' adapter, pooling over 15 slots leaning forward (a slot's score to the 14 after "
                       "it)", {"lookahead": {"kernel": 15, "pool_offset": 7},
                               "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes"),
    "codes_after_31": ("data_codes' adapter, pooling over 31 slots leaning forward (a slot's score to the 30 after "
                       "it)", {"lookahead": {"kernel": 31, "pool_offset": 15},
                               "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes"),
    # the raw scores peak on a needle's key and on the end of its value, and sag inside it (value_coverage.py)
    "codes_bridge_32": ("data_codes' adapter, pooling over 15, valleys up to 32 slots each side bridged",
                        {"lookahead": {"kernel": 15, "bridge": 32},
                         "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes"),
    # centred and forward at once: a peak lends to the 23 slots after it and the 7 before
    "codes_k31_o8": ("data_codes' adapter, pooling over 31 slots, offset 8 (a slot's score to the 23 after it, "
                     "the 7 before)", {"lookahead": {"kernel": 31, "pool_offset": 8},
                                       "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes"),
    "tokens_8_codes_after_31": ("tokens_8_codes' adapter, pooling as codes_after_31",
                                {"lookahead": {"n_tokens": 8, "kernel": 31, "pool_offset": 15},
                                 "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "tokens_8_codes"),
    "tokens_8_codes_k31_o8": ("tokens_8_codes' adapter, pooling as codes_k31_o8",
                              {"lookahead": {"n_tokens": 8, "kernel": 31, "pool_offset": 8},
                               "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "tokens_8_codes"),
    # the tail without the budget: slots after a peak get half its score, outranking weak slots, not other peaks
    "tokens_8_codes_tail_30": ("tokens_8_codes' adapter, pooling over 15, and a slot at least half the highest "
                               "score of the 30 before it", {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30,
                                                                           "tail_weight": 0.5},
                                                             "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                               "tokens_8_codes"),
    "tokens_8_codes_tail_30_w25": ("as tokens_8_codes_tail_30, a quarter of the score",
                                   {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30, "tail_weight": 0.25},
                                    "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "tokens_8_codes"),
    # tokens_8_seed_1 moved 11 points from tokens_8: a trained variant's difference needs its own spread
    "data_codes_seed_1": ("data_codes with another training seed (init and batch order)",
                          {"train": {"seed": 1}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, False),
    "codes_seed_1_kernel_15": ("data_codes_seed_1's adapter, pooling over 15",
                               {"lookahead": {"kernel": 15}, "train": {"seed": 1},
                                "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes_seed_1"),
    "tokens_8_codes_seed_1": ("tokens_8_codes with another training seed",
                              {"lookahead": {"n_tokens": 8}, "train": {"seed": 1},
                               "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, False),
    "tokens_8_codes_seed_1_tail_30": ("tokens_8_codes_seed_1's adapter, scored as tokens_8_codes_tail_30",
                                      {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30, "tail_weight": 0.5},
                                       "train": {"seed": 1}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                                      "tokens_8_codes_seed_1"),
    # seed 1 of the best recipe scored 17 points under seed 0 (tail_30 both): a third seed to place the two
    "tokens_8_codes_seed_2": ("tokens_8_codes with training seed 2",
                              {"lookahead": {"n_tokens": 8}, "train": {"seed": 2},
                               "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, False),
    "tokens_8_codes_seed_2_tail_30": ("tokens_8_codes_seed_2's adapter, scored as tokens_8_codes_tail_30",
                                      {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30, "tail_weight": 0.5},
                                       "train": {"seed": 2}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                                      "tokens_8_codes_seed_2"),
    # the seeds of one recipe as one scorer: the mean of their lookahead attention (8 tokens each, one pass each)
    "tokens_8_codes_ens_2_tail_30": ("tokens_8_codes seeds 0 and 1 as one ensemble, scored as tokens_8_codes_tail_30",
                                     {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30, "tail_weight": 0.5},
                                      "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                                     ("tokens_8_codes", "tokens_8_codes_seed_1")),
    "tokens_8_codes_ens_3_tail_30": ("tokens_8_codes seeds 0, 1 and 2 as one ensemble, scored as "
                                     "tokens_8_codes_tail_30",
                                     {"lookahead": {"n_tokens": 8, "kernel": 15, "tail": 30, "tail_weight": 0.5},
                                      "data": {"sources": [{"tasks": ["ood_train_codes"]}]}},
                                     ("tokens_8_codes", "tokens_8_codes_seed_1", "tokens_8_codes_seed_2")),
    # the tail scoring on the 32-token codes recipe, both seeds: with tokens_8_codes' two, a 2 x 2 of recipe and seed
    "codes_tail_30": ("data_codes' adapter, scored as tokens_8_codes_tail_30",
                      {"lookahead": {"kernel": 15, "tail": 30, "tail_weight": 0.5},
                       "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes"),
    "codes_seed_1_tail_30": ("data_codes_seed_1's adapter, scored as tokens_8_codes_tail_30",
                             {"lookahead": {"kernel": 15, "tail": 30, "tail_weight": 0.5}, "train": {"seed": 1},
                              "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}, "data_codes_seed_1"),
}
# tokens_8_codes' seeds differ by 17 points, most on the multi-needle tasks, and the 135M model's own answers to the
# lines families are rarely right (the full cache scores 6 on them): a recipe whose targets are the reference answers
# (teacher-forced: `targets.teacher: answer`, the attention the frozen model pays to the prompt while reading the
# right answer) and whose data adds questions that ask for several records at once, with three seeds from the start
ANSWER_MULTI = {"lookahead": {"n_tokens": 8}, "targets": {"teacher": "answer"},
                "data": {"sources": [{"tasks": ["ood_train_codes"]},
                                     {"kind": "synthetic", "tasks": ["ood_train_multi"], "context_length": 2048,
                                      "num_samples": 64, "seed": 0}]}}
TAIL_30 = {"kernel": 15, "tail": 30, "tail_weight": 0.5}
for _seed in (0, 1, 2):
    _name = "answer_multi" + (f"_seed_{_seed}" if _seed else "")
    _over = {**ANSWER_MULTI, **({"train": {"seed": _seed}} if _seed else {})}
    VARIANTS[_name] = (f"tokens_8_codes' recipe plus 64 `ood_train_multi` prompts (2-4 records asked at once), "
                       f"targets from the reference answers (`teacher: answer`), training seed {_seed}", _over, False)
    VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                    {**_over, "lookahead": {**ANSWER_MULTI["lookahead"], **TAIL_30}}, _name)
# tokens_8_codes' loss still falls at step 150 (0.151 over steps 100-125, 0.138 over 125-150, every seed): trained
# twice as long, do its seeds meet?
CODES_8 = {"lookahead": {"n_tokens": 8}, "data": {"sources": [{"tasks": ["ood_train_codes"]}]}}
for _seed in (0, 1, 2):
    _name = "tokens_8_codes_steps_300" + (f"_seed_{_seed}" if _seed else "")
    _over = {**CODES_8, "train": {"steps": 300, **({"seed": _seed} if _seed else {})}}
    VARIANTS[_name] = (f"tokens_8_codes trained for 300 steps, training seed {_seed}", _over, False)
    VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                    {**_over, "lookahead": {**CODES_8["lookahead"], **TAIL_30}}, _name)

# seed 0 leads at 150 and at 300 steps, and a training seed sets two things: the adapter's initialisation and the
# batch order. Each moved alone (`train.init_seed`), the other held at seed 0's
for _seed in (1, 2):
    for _name, _train, _what in ((f"tokens_8_codes_init_{_seed}", {"init_seed": _seed}, "initialisation"),
                                 (f"tokens_8_codes_order_{_seed}", {"seed": _seed, "init_seed": 0}, "batch order")):
        _over = {**CODES_8, "train": _train}
        VARIANTS[_name] = (f"tokens_8_codes with its {_what} from seed {_seed}, the other from seed 0", _over, False)
        VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                        {**_over, "lookahead": {**CODES_8["lookahead"], **TAIL_30}}, _name)

# the initialisation is two draws: the 8 vocabulary tokens whose embeddings start the lookahead tokens, and the LoRA
# factors. Seeds 0 and 1 drew these ids (`init_adapter`, SmolLM2's 49,152 tokens, JAX 0.10); each swapped alone
INIT_TOKENS = {0: [39303, 35809, 28367, 37885, 180, 14756, 24779, 20209],  # ' rebellious' ... '�' (a byte) ... ' lava'
               1: [19458, 37797, 19432, 42851, 25348, 12153, 46026, 34399],  # ' housed', ' Memor', ')"', ' FREE' ...
               2: [35532, 38536, 7493, 45179, 22381, 14473, 16126, 15166],
               3: [29985, 40895, 17825, 240, 2320, 14233, 25254, 25122],
               4: [8559, 37180, 26379, 25489, 18563, 30983, 10054, 15395],
               5: [21306, 48180, 8128, 3169, 1034, 35573, 18814, 6871]}
for _name, _train, _what in (
        ("tokens_8_codes_init_1_tokens_0", {"init_seed": 1, "init_tokens": INIT_TOKENS[0]},
         "LoRA initialisation from seed 1, lookahead tokens from seed 0's token embeddings"),
        ("tokens_8_codes_tokens_1", {"init_tokens": INIT_TOKENS[1]},
         "seed 0 but the lookahead tokens from seed 1's token embeddings")):
    _over = {**CODES_8, "train": _train}
    VARIANTS[_name] = (f"tokens_8_codes with its {_what} (batch order 0)", _over, False)
    VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                    {**_over, "lookahead": {**CODES_8["lookahead"], **TAIL_30}}, _name)

# the token draw, not the LoRA init or the batch order, moved the score: seed 0's token ids at seeds 1 and 2 (LoRA
# init and batch order both theirs) -- with tokens_8_codes (which drew those ids) a recipe at three seeds
for _seed in (1, 2):
    _name = f"tokens_8_codes_tokens_0_seed_{_seed}"
    _over = {**CODES_8, "train": {"seed": _seed, "init_tokens": INIT_TOKENS[0]}}
    VARIANTS[_name] = (f"tokens_8_codes, lookahead tokens from seed 0's token embeddings, training seed {_seed} (LoRA "
                       "init and batch order)", _over, False)
    VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                    {**_over, "lookahead": {**CODES_8["lookahead"], **TAIL_30}}, _name)


# the three seeds of seed 0's token ids as one scorer (the mean of their lookahead attention, 3 x 8 rows)
VARIANTS["tokens_8_codes_tokens_0_ens_3_tail_30"] = (
    "seed 0's token ids at seeds 0, 1 and 2 as one ensemble, scored as tokens_8_codes_tail_30",
    {**CODES_8, "lookahead": {**CODES_8["lookahead"], **TAIL_30}},
    ("tokens_8_codes", "tokens_8_codes_tokens_0_seed_1", "tokens_8_codes_tokens_0_seed_2"))

# choosing the draw without RULER: more token draws (seeds 3-5's ids; LoRA init and batch order seed 0's), each
# probed on held-out prose (`seed_selection.py --part fidelity`) before RULER scores it
for _seed in (3, 4, 5):
    _name = f"tokens_8_codes_tokens_{_seed}"
    _over = {**CODES_8, "train": {"init_tokens": INIT_TOKENS[_seed]}}
    VARIANTS[_name] = (f"tokens_8_codes with its seed 0 but the lookahead tokens from seed {_seed}'s token embeddings "
                       "(batch order 0)", _over, False)
    VARIANTS[_name + "_tail_30"] = (f"{_name}'s adapter, scored as tokens_8_codes_tail_30",
                                    {**_over, "lookahead": {**CODES_8["lookahead"], **TAIL_30}}, _name)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, list) and isinstance(out.get(k), list) and v and isinstance(v[0], dict):
            # list items merge with the base's item at the same index; items past the base's are new
            out[k] = [_merge(a, b) for a, b in zip(out[k], v)] + copy.deepcopy(v[len(out[k]):])
        else:
            out[k] = v
    return out


def variant_config(name: str) -> dict:
    """The run config (a YAML mapping) of variant `name`."""
    _, over, _ = VARIANTS[name]
    return _merge(_merge(yaml.safe_load(BASE.read_text()), ENGINEERING), over)


def parents_of(name: str) -> tuple[str, ...]:
    """The trained variants whose adapters an eval-only variant reuses (one; several for an ensemble), or the
    variant itself for a trained one."""
    eval_only = VARIANTS[name][2]
    if isinstance(eval_only, tuple):
        return eval_only
    return (eval_only,) if isinstance(eval_only, str) else ("base",) if eval_only else (name,)


def parent_of(name: str) -> str:
    """The trained variant whose adapter an eval-only variant reuses (itself for a trained one; an ensemble's
    first member)."""
    return parents_of(name)[0]


def targets_owner(name: str) -> str:
    """The first trained variant (in `VARIANTS` order) whose model, data and targets sections equal `name`'s:
    the one that computes the targets `name` then shares (itself when none comes before it)."""
    cfg = variant_config(name)
    return next(v for v, (_, _, eval_only) in VARIANTS.items()
                if not eval_only and all(variant_config(v)[s] == cfg[s] for s in SHARED))


def _sh(cmd: list[str], log: pathlib.Path) -> float:
    start = time.time()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return time.time() - start


CARD_FILES = ("README.md", "adapter_config.json", "train_config.json", "log.jsonl", "loss_curve.png")


def run(names: list[str], runs: pathlib.Path, evaluate: bool = True) -> None:
    runs.mkdir(parents=True, exist_ok=True)
    for name in names:
        desc, over, eval_only = VARIANTS[name]
        cfg = variant_config(name)
        (HERE / "configs").mkdir(exist_ok=True)
        cfg_path = HERE / "configs" / f"{name}.yaml"
        cfg_path.write_text(f"# {name}: {desc} (eval/lookahead_ablations/ablations.py)\n" + yaml.safe_dump(cfg))
        work = runs / name
        export = work / "export"  # the adapter the eval reads (weights stay out of the repository)
        card = HERE / "adapters" / name  # its card, config, log and times (no weights)
        card.mkdir(parents=True, exist_ok=True)
        times = json.loads((card / "times.json").read_text()) if (card / "times.json").exists() else {}
        log = runs / f"{name}.log"
        if not (export / "adapter.safetensors").exists():
            if eval_only:
                parents = parents_of(name)
                for parent in parents:
                    if not (runs / parent / "export" / "adapter.safetensors").exists():  # else its eval may run elsewhere
                        run([parent], runs, evaluate)
                if len(parents) == 1:
                    shutil.copytree(runs / parents[0] / "export", export, dirs_exist_ok=True)
                    conf = json.loads((export / "adapter_config.json").read_text())
                    conf["config"].update(over["lookahead"])
                    (export / "adapter_config.json").write_text(json.dumps(conf, indent=2) + "\n")
                else:
                    members = [lk.load(runs / p / "export") for p in parents]
                    config = lk.LookaheadConfig.from_dict({**members[0].config.to_dict(), **over["lookahead"]})
                    lk.save(lk.stack(members, config=config), export)
                times = {"train": f"the {' + '.join(parents)}'s adapter" + ("s" if len(parents) > 1 else "")}
            else:
                owner = targets_owner(name)
                if owner != name:
                    work.mkdir(parents=True, exist_ok=True)
                    if not (runs / owner / "targets" / "manifest.json").exists():
                        raise SystemExit(f"{name} shares {owner}'s targets: run {owner} first")
                    if not (work / "targets").exists():
                        (work / "targets").symlink_to((runs / owner / "targets").resolve(), target_is_directory=True)
                    times["targets"] = f"shared with {owner}"
                times["train_seconds"] = round(_sh([sys.executable, "-m", "train_lookahead", "--config",
                                                    str(cfg_path), "--workdir", str(work), "--no-progress"], log))
                times["prompt_cache"] = bool(cfg["targets"].get("prompt_cache"))
        for f in CARD_FILES:
            if (export / f).exists():
                shutil.copy2(export / f, card / f)
        out = HERE / "results" / name
        if evaluate and not (out / "metrics.json").exists():
            out.mkdir(parents=True, exist_ok=True)
            if not (out / "results.jsonl").exists():  # the full cache's rows of the same samples
                rows = [l for l in FULL_ROWS.read_text().splitlines() if json.loads(l)["policy"] == "full"]
                (out / "results.jsonl").write_text("\n".join(rows) + "\n")
            times["eval_seconds"] = round(_sh([sys.executable, "-m", "kvjax.eval", *EVAL, "--lookahead",
                                               str(export), "--out", str(out)], log))
        (card / "times.json").write_text(json.dumps(times, indent=1) + "\n")


def _scores(name: str) -> dict[str, dict[str, float]]:
    """{setting: {sample_id: score}} of lookahead_kv and the full cache in results/NAME."""
    out: dict[str, dict[str, float]] = {}
    path = HERE / "results" / name / "results.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if r["policy"] in ("lookahead_kv", "full"):
            out.setdefault(r["setting"], {})[r["sample_id"]] = r["score"]
    return out


# (the same recipe at another seed, the variant it repeats): their difference is training noise alone
SEED_PAIRS = {"tokens_8_seed_1": "tokens_8", "data_codes_seed_1": "data_codes",
              "codes_seed_1_kernel_15": "codes_kernel_15", "tokens_8_codes_seed_1": "tokens_8_codes",
              "tokens_8_codes_seed_1_tail_30": "tokens_8_codes_tail_30", "codes_seed_1_tail_30": "codes_tail_30",
              "tokens_8_codes_seed_2": "tokens_8_codes", "tokens_8_codes_seed_2_tail_30": "tokens_8_codes_tail_30",
              **{f"{r}_seed_{s}{t}": f"{r}{t}" for r in ("answer_multi", "tokens_8_codes_steps_300") for s in (1, 2)
                 for t in ("", "_tail_30")}}


# a recipe's seeds (its variant first): compared as the per-sample mean over the seeds, since one seed's lead over
# another recipe's one seed can be training noise (tokens_8_codes' seeds differ by 17 points)
SEED_GROUPS = {"tokens_8_codes": ("tokens_8_codes", "tokens_8_codes_seed_1", "tokens_8_codes_seed_2"),
               "tokens_8_codes_tail_30": ("tokens_8_codes_tail_30", "tokens_8_codes_seed_1_tail_30",
                                          "tokens_8_codes_seed_2_tail_30"),
               "answer_multi_tail_30": ("answer_multi_tail_30", "answer_multi_seed_1_tail_30",
                                        "answer_multi_seed_2_tail_30"),
               "tokens_8_codes_steps_300_tail_30": ("tokens_8_codes_steps_300_tail_30",
                                                    "tokens_8_codes_steps_300_seed_1_tail_30",
                                                    "tokens_8_codes_steps_300_seed_2_tail_30"),
               # one factor of the seed at a time, the other at seed 0's (not a recipe: the spread's source)
               "tokens_8_codes_init_tail_30": ("tokens_8_codes_tail_30", "tokens_8_codes_init_1_tail_30",
                                               "tokens_8_codes_init_2_tail_30"),
               "tokens_8_codes_order_tail_30": ("tokens_8_codes_tail_30", "tokens_8_codes_order_1_tail_30",
                                                "tokens_8_codes_order_2_tail_30"),
               # seed 0's token ids at every seed (tokens_8_codes drew them itself)
               "tokens_8_codes_tokens_0_tail_30": ("tokens_8_codes_tail_30", "tokens_8_codes_tokens_0_seed_1_tail_30",
                                                   "tokens_8_codes_tokens_0_seed_2_tail_30"),
               # five draws of the token ids (0, 1, 3, 4, 5), LoRA init and batch order seed 0's: the probe's pool
               "tokens_8_codes_draws_tail_30": ("tokens_8_codes_tail_30", "tokens_8_codes_tokens_1_tail_30",
                                                "tokens_8_codes_tokens_3_tail_30", "tokens_8_codes_tokens_4_tail_30",
                                                "tokens_8_codes_tokens_5_tail_30")}
# (recipe, the recipe it is measured against): both seed-means over the same samples
GROUP_PAIRS = (("answer_multi_tail_30", "tokens_8_codes_tail_30"),
               ("tokens_8_codes_steps_300_tail_30", "tokens_8_codes_tail_30"),
               ("tokens_8_codes_tokens_0_tail_30", "tokens_8_codes_tail_30"))


def _seed_mean(group: str) -> dict[str, dict[str, float]]:
    """{setting: {sample_id: mean score over the group's seeds}} over the samples every seed ran (empty while a
    seed has not run)."""
    runs = [_scores(v) for v in SEED_GROUPS[group]]
    out: dict[str, dict[str, float]] = {}
    for setting in ("r=0.5", "r=0.75"):
        shared = set.intersection(*(set(r.get(setting, {})) for r in runs))
        if shared:
            out[setting] = {k: sum(r[setting][k] for r in runs) / len(runs) for k in shared}
    return out


def _seed_groups() -> list[str]:
    rows = []
    for group, members in SEED_GROUPS.items():
        runs = [_scores(v) for v in members]
        cells = []
        for setting in ("r=0.5", "r=0.75"):
            got = [r.get(setting, {}) for r in runs]
            cells.append(" / ".join(f"{100 * sum(g.values()) / len(g):.1f}" if g else "-" for g in got))
        mean = _seed_mean(group)
        cells += [f"{100 * sum(m.values()) / len(m):.1f}" if (m := mean.get(k)) else "" for k in ("r=0.5", "r=0.75")]
        rows.append(f"| {group} | " + " | ".join(cells) + " |")
    pairs = []
    for a, b in GROUP_PAIRS:
        ma, mb = _seed_mean(a), _seed_mean(b)
        if ma.get("r=0.5") and mb.get("r=0.5"):
            pairs.append(f"| {a} - {b} | " + " | ".join(_paired(ma.get(k, {}), mb.get(k, {}))
                                                     for k in ("r=0.5", "r=0.75")) + " |")
    if not any("-" not in r.split("|")[2] for r in rows):
        return []
    return ["", "## Recipes over seeds", "",
            "A recipe is its seeds (training seeds 0 / 1 / 2: LoRA init and batch order), each scored on the same "
            "samples; mean = the per-sample mean over the three (shown once all three ran). Recipes are compared by "
            "that mean, paired over the samples, ± its standard error stratified by task. The `_init` and `_order` "
            "rows move one part of the seed (`train.init_seed`: the adapter's initialisation; `train.seed` with "
            "init_seed 0: the batch order) and hold the other at seed 0's; `_tokens_0` starts every seed's lookahead tokens from the "
            "embeddings seed 0 drew (`train.init_tokens`); `_draws` lists five draws of those ids instead (seeds 0, 1, 3, 4 "
            "and 5's), the LoRA init and batch order held at seed 0's.", "",
            "| recipe | r=0.5, seeds 0 / 1 / 2 | r=0.75, seeds 0 / 1 / 2 | mean r=0.5 | mean r=0.75 |",
            "|---|---:|---:|---:|---:|", *rows,
            *(["", "| recipes (seed means) | diff r=0.5 | diff r=0.75 |", "|---|---:|---:|", *pairs] if pairs else [])]


def _paired(got: dict[str, float], ref: dict[str, float]) -> str:
    """got - ref over the shared samples, in points, ± its standard error stratified by task ("" if none)."""
    by_task: dict[str, list[float]] = {}
    for k in got:
        if k in ref:
            by_task.setdefault(k.rsplit("/", 1)[0], []).append(100 * (got[k] - ref[k]))
    return plus_minus(*task_mean_se(by_task), sign=True) if by_task else ""


def _reference_rows(policy: str) -> dict[str, dict[str, float]]:
    """{setting: {sample_id: score}} of `policy` in the recorded agnostic run (the training-free rows)."""
    out: dict[str, dict[str, float]] = {}
    for line in FULL_ROWS.read_text().splitlines():
        r = json.loads(line)
        if r["policy"] == policy and r.get("score") is not None:
            out.setdefault(r["setting"], {})[r["sample_id"]] = r["score"]
    return out


# tokens_8_codes (tail scoring) with the three draws of a training seed set apart: the batch order (`train.seed`), the
# LoRA factors (`train.init_seed`) and the lookahead tokens' starting embeddings (`train.init_tokens`, else drawn by
# the init seed)
SEED_PARTS = ("tokens_8_codes_tail_30", "tokens_8_codes_seed_1_tail_30", "tokens_8_codes_seed_2_tail_30",
              "tokens_8_codes_order_1_tail_30", "tokens_8_codes_order_2_tail_30", "tokens_8_codes_init_1_tail_30",
              "tokens_8_codes_init_2_tail_30", "tokens_8_codes_init_1_tokens_0_tail_30",
              "tokens_8_codes_tokens_1_tail_30", "tokens_8_codes_tokens_0_seed_1_tail_30",
              "tokens_8_codes_tokens_0_seed_2_tail_30", "tokens_8_codes_tokens_3_tail_30",
              "tokens_8_codes_tokens_4_tail_30", "tokens_8_codes_tokens_5_tail_30")


def seed_parts(name: str) -> tuple[int, int, int]:
    """(batch-order seed, LoRA seed, token-ids seed) of a variant: which seed drew each part of its start."""
    train = variant_config(parent_of(name))["train"]
    order = train.get("seed", 0)
    lora = train.get("init_seed") if train.get("init_seed") is not None else order
    tokens = train.get("init_tokens")
    drew = lora if tokens is None else next(s for s, ids in INIT_TOKENS.items() if list(ids) == list(tokens))
    return order, lora, drew


def _seed_parts() -> list[str]:
    ref = _scores(SEED_PARTS[0])
    rows = []
    for name in SEED_PARTS:
        got = _scores(name)
        if not got.get("r=0.5"):
            continue
        cells = [f"{100 * sum(g.values()) / len(g):.1f}" if (g := got.get(k)) else "" for k in ("r=0.5", "r=0.75")]
        diffs = [_paired(got.get(k, {}), ref.get(k, {})) if name != SEED_PARTS[0] else "" for k in ("r=0.5", "r=0.75")]
        rows.append(f"| {name} | " + " | ".join(map(str, seed_parts(name))) + " | " + " | ".join(cells + diffs) + " |")
    if len(rows) < 2:
        return []
    return ["", "## What in the seed moves the score", "",
            "tokens_8_codes (scored with the tail) with the three draws of a training seed set apart: the batch order "
            "(`train.seed`), the LoRA factors (`train.init_seed`) and the 8 vocabulary tokens whose embeddings start "
            "the lookahead tokens (`train.init_tokens`, else drawn with the LoRA factors); diff = against seed 0 "
            "(all three from seed 0) on the same samples.", "",
            "| variant | batch order | LoRA init | token ids | r=0.5 | r=0.75 | diff r=0.5 | diff r=0.75 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|", *rows]


def _ood_12() -> list[str]:
    """The 12-sample rounds (ood_12/NAME: 132 paired samples a setting, the goal's size) against KVzip and the
    full cache of the recorded 12-sample agnostic table, on the same samples."""
    def scores(path: pathlib.Path) -> dict[tuple[str, str], dict[str, float]]:
        got: dict[tuple[str, str], dict[str, float]] = {}
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("score") is not None:
                got.setdefault((r["policy"], r["setting"]), {})[r["sample_id"]] = r["score"]
        return got

    table_12 = ROOT / "eval" / "smollm2_ruler_2k" / "table_agnostic_12" / "results.jsonl"
    kvzip = {k: v for k, v in scores(table_12).items() if k[0] == "kvzip"} if table_12.exists() else {}
    rows = []
    for d in sorted((HERE / "ood_12").glob("*/results.jsonl")):
        got = {**kvzip, **scores(d)}  # a folder's own KVzip rows, else the recorded table's
        cells = []
        for setting in ("r=0.5", "r=0.75"):
            preset = next((p for p, _ in got if "lookahead" in p), "lookahead_kv")  # ada_ folders: ada_lookahead_kv
            lk, kz = got.get((preset, setting), {}), got.get(("kvzip", setting), {})
            shared = [k for k in lk if k in kz]
            later = [k for k in shared if int(k.rsplit("/", 1)[1]) >= 4]  # not among the samples chosen on
            cells += [f"{100 * sum(lk.values()) / len(lk):.1f} ({len(lk)})" if lk else "not run",
                      f"{100 * sum(kz[k] for k in shared) / len(shared):.1f}" if shared else "",
                      _paired({k: lk[k] for k in shared}, kz), _paired({k: lk[k] for k in later}, kz)]
        rows.append(f"| {d.parent.name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["", "## At the goal's sample size", "",
            "The best rows again over 12 samples a task (132 paired a setting; `ood_12/NAME`, the 4-sample rows "
            "extended with `kvjax.eval --num-samples 12` into the same folder), against KVzip's rows of the "
            "recorded 12-sample agnostic table (`eval/smollm2_ruler_2k/table_agnostic_12`) on the same samples; "
            "diff = the LookaheadKV preset (lookahead_kv; in a prefixed row the composition its prefix names: "
            "ada_lookahead_kv, critical_lookahead_kv, critical_ada_lookahead_kv, their `_l2` norm, cake_lookahead_kv)"
            " - KVzip ± its standard error stratified by task; \"diff, 4-11\": the same over each "
            "task's samples 4-11 alone (88 a setting), those the scoring options were not chosen on (the 4-sample "
            "table above is samples 0-3).", "",
            "| adapter, scoring | r=0.5 (samples) | KVzip | diff | diff, 4-11 | r=0.75 (samples) | KVzip | diff "
            "| diff, 4-11 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]


def table() -> str:
    lines = ["# LookaheadKV recipe ablations, SmolLM2-135M-Instruct, out of distribution (issue 27)", "",
             "Trained on `ood_train` (kvjax.data.lines) only (the `*_codes` variants: `ood_train_codes`, the same "
             "suite plus numbered records ending in codes); scored on RULER 2K question-agnostic, the 11 offline "
             "tasks x 4 samples, lookahead_kv at r = 0.5 / 0.75; diff = the variant minus the base on the same "
             "samples, ± its standard error stratified by task. Train = wall seconds of `python -m train_lookahead` "
             "on the 2-core CPU shared with other jobs (targets shared where said; \"stored prompt cache\": the train steps "
             "read the frozen prefill's cache written with the targets instead of prefilling each step, the same loss); "
             "eval-only variants reuse the "
             "named adapter (the base's unless said) with inference-time fields changed.", "",
             "| variant | what changes | train s | r=0.5 | r=0.75 | diff r=0.5 | diff r=0.75 | samples |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = _scores("base")
    for name, (desc, _, eval_only) in VARIANTS.items():
        s = _scores(name)
        times_path = HERE / "adapters" / name / "times.json"
        times = json.loads(times_path.read_text()) if times_path.exists() else {}
        parents = parents_of(name)
        train = ("eval only" + ("" if parents == ("base",) else f" ({' + '.join(parents)}'s adapter"
                                + ("s)" if len(parents) > 1 else ")")) if eval_only
                 else str(times.get("train_seconds", "")))
        notes = ["stored prompt cache"] if times.get("prompt_cache") else []
        if str(times.get("targets", "")).startswith("shared with "):
            notes.append(f"+ {times['targets'][len('shared with '):]}'s targets")
        train += f" ({'; '.join(notes)})" if notes else ""
        cells, diffs, counts = [], [], []
        for setting in ("r=0.5", "r=0.75"):
            got = s.get(setting, {})
            if not got:
                cells.append("not run"), diffs.append(""), counts.append("0")
                continue
            cells.append(f"{100 * sum(got.values()) / len(got):.1f}")
            counts.append(str(len(got)))
            diffs.append(_paired(got, base.get(setting, {})) if name != "base" else "")
        lines.append(f"| {name} | {desc} | {train} | {cells[0]} | {cells[1]} | {diffs[0]} | {diffs[1]} | "
                     f"{'/'.join(counts)} |")
    full = _scores("base").get("full", {})
    if full:
        lines += ["", f"Full cache on the same samples: {100 * sum(full.values()) / len(full):.1f} ({len(full)})."]
    kvzip = _reference_rows("kvzip")
    if kvzip and base:
        cells = [f"{100 * sum(kvzip[k][i] for i in base[k]) / len(base[k]):.1f}" for k in ("r=0.5", "r=0.75")
                 if k in kvzip and k in base and all(i in kvzip[k] for i in base[k])]
        if len(cells) == 2:
            lines.append(f"KVzip (training-free, 5.5x the prefill) on the same samples: {cells[0]} / {cells[1]}.")
    lines += _ood_12()
    lines += _seed_groups()
    lines += _seed_parts()
    spread = []
    for name, of in SEED_PAIRS.items():
        a, b = _scores(name), _scores(of)
        if a.get("r=0.5") and b.get("r=0.5"):
            spread.append(f"| {name} - {of} | " + " | ".join(_paired(a.get(k, {}), b.get(k, {})) for k in
                                                               ("r=0.5", "r=0.75")) + " |")
    if spread:
        lines += ["", "## Run-to-run spread", "",
                  "The same recipe trained again with another seed (LoRA init and batch order), scored on the same "
                  "samples: the difference is training noise, which the ± above (sample noise, one adapter each) "
                  "leaves out. A trained variant's difference from the base smaller than this spread is not a "
                  "finding; an eval-only variant's (the same adapter, scored another way) is not subject to it.", "",
                  "| pair | diff r=0.5 | diff r=0.75 |", "|---|---:|---:|", *spread]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train and score the variants (resumes)")
    r.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these variants (default: all, in order)")
    r.add_argument("--runs", default="runs/lookahead_ablations", help="training workdirs")
    r.add_argument("--train-only", action="store_true",
                   help="train (or assemble) the adapters, score none (another process may score them meanwhile)")
    sub.add_parser("table", help="print the Markdown table of what has run")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.only or list(VARIANTS), pathlib.Path(args.runs).resolve(), evaluate=not args.train_only)
    else:
        sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
