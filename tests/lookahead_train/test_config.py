"""train_lookahead's typed config: unknown keys and bad values are clear errors; shipped configs parse."""

import dataclasses
import pathlib

import pytest
import yaml

from train_lookahead.config import RunConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["lookahead_bundled.yaml", "lookahead_smollm2.yaml", "lookahead_smollm2_ood.yaml",
                                  "lookahead_smoke.yaml",
                                  "lookahead_llama31_8b_v5e.yaml"])
def test_shipped_configs_parse_and_round_trip(name):
    cfg = RunConfig.from_yaml(CONFIGS / name)
    raw = yaml.safe_load((CONFIGS / name).read_text())
    assert cfg.train.batch_size == raw["train"]["batch_size"]
    assert cfg.lookahead.n_tokens == raw["lookahead"]["n_tokens"]
    assert len(cfg.data.sources) == len(raw["data"]["sources"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("d, names", [
    ({"trian": {"steps": 3}}, ["trian"]),
    ({"train": {"steps": 3, "batchsize": 2, "lr": 1}}, ["batchsize", "lr"]),
    ({"data": {"sources": [{"kind": "synthetic", "num_samples": 2}, {"kind": "jsonl", "path": "x", "feild": 1}]}},
     ["feild", "data.sources[1]"]),
    ({"lookahead": {"n_token": 4}}, ["n_token"]),
])
def test_unknown_keys_are_named(d, names):
    with pytest.raises(ValueError, match="unknown") as e:
        RunConfig.from_dict(d)
    for n in names:
        assert n in str(e.value)


@pytest.mark.parametrize("d, words", [
    ({"data": {"sources": [{"kind": "csv", "path": "x"}]}}, ["data.sources[0].kind", "'jsonl'"]),
    ({"targets": {"dtype": "int8"}}, ["targets.dtype", "'float16'"]),
    ({"train": {"steps": "ten"}}, ["train.steps"]),
    ({"train": {"batch_size": 0}}, ["train.batch_size"]),
    ({"data": {"long_prompts": "truncate"}}, ["data.long_prompts", "'skip'"]),
    ({"data": {"sources": [{"kind": "jsonl"}]}}, ["data.sources[0].path"]),
    ({"optim": {"warmup_fraction": 1.5}}, ["optim.warmup_fraction"]),
    ({"train": {"loss": "ranking"}}, ["train.loss", "'kl'", "'topk'"]),
    ({"train": {"loss": "topk", "topk_fraction": 1.5}}, ["train.topk_fraction", "(0, 1]"]),
    ({"lookahead": {"n_tokens": 8, "span": 4}}, ["span", ">= 8"]),
    ({"train": {"init_seed": -1}}, ["train.init_seed", ">= 0 or null"]),
    ({"lookahead": {"n_tokens": 2}, "train": {"init_tokens": [5, 6, 7]}}, ["train.init_tokens", "n_tokens=2"]),
    ({"lookahead": {"n_tokens": 2}, "train": {"init_tokens": [5, -6]}}, ["train.init_tokens", ">= 0"]),
])
def test_bad_values_name_the_field(d, words):
    with pytest.raises(ValueError) as e:
        RunConfig.from_dict(d)
    for w in words:
        assert w in str(e.value)


def test_yaml_exponent_floats_and_missing_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: 2e-4\n")  # YAML 1.1 reads this as a string
    assert RunConfig.from_yaml(path).optim.learning_rate == pytest.approx(2e-4)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        RunConfig.from_yaml(tmp_path / "nope.yaml")


def _unseeded(train: dict, init_tokens: dict) -> dict:
    """A train section with its seed at 0 and its token ids resolved (none given: the ids its seed draws)."""
    drew = train.get("init_tokens") or init_tokens[train.get("seed", 0)]
    return {**train, "seed": 0, "init_tokens": list(drew)}


def _same_recipe(a: dict, b: dict, init_tokens: dict) -> bool:
    """Two train sections of one recipe at two seeds: both draw their token ids by their seed, or both start
    from the same ids (one may draw them itself)."""
    if not a.get("init_tokens") and not b.get("init_tokens"):
        return {**a, "seed": 0} == {**b, "seed": 0}
    return _unseeded(a, init_tokens) == _unseeded(b, init_tokens)


def test_every_ablation_variant_is_a_valid_run_config_that_changes_one_thing():
    """eval/lookahead_ablations: each variant parses, and differs from the base only where it says."""
    import importlib.util

    path = CONFIGS.parent / "eval" / "lookahead_ablations" / "ablations.py"
    spec = importlib.util.spec_from_file_location("ablations", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    base = RunConfig.from_dict(ab.variant_config("base"))
    recipe = RunConfig.from_yaml(CONFIGS / "lookahead_smollm2_ood.yaml")  # the base, but for how it trains:
    assert base == dataclasses.replace(recipe, targets=dataclasses.replace(recipe.targets, prompt_cache=True))
    for name, (_, over, eval_only) in ab.VARIANTS.items():
        cfg = RunConfig.from_dict(ab.variant_config(name))
        changed = {s for s in ("model", "lookahead", "data", "targets", "train", "optim")
                   if getattr(cfg, s) != getattr(base, s)}
        assert changed == set(over), name
        if eval_only:  # only inference-time fields beyond the trained variant whose adapter serves
            parent = ab.parent_of(name)
            assert not ab.VARIANTS[parent][2] and set(over) == {"lookahead"} | set(ab.VARIANTS[parent][1])
            added = {k for k, v in over["lookahead"].items() if ab.VARIANTS[parent][1].get("lookahead", {}).get(k) != v}
            assert added <= {"gqa_reduce", "pooling", "kernel", "pool_offset", "bridge", "tail", "tail_weight"}, name
            assert all(ab.variant_config(name)[s] == ab.variant_config(parent)[s] for s in ("model", "data", "train"))
            for member in ab.parents_of(name)[1:]:  # an ensemble: the first member's recipe at other seeds
                other = ab.variant_config(member)
                assert not ab.VARIANTS[member][2], name
                assert all(other[s] == ab.variant_config(parent)[s] for s in ("model", "data", "lookahead")), name
                assert _same_recipe(other["train"], ab.variant_config(parent)["train"], ab.INIT_TOKENS), name
                assert other["train"]["seed"] != ab.variant_config(parent)["train"]["seed"], name
    assert RunConfig.from_dict(ab.variant_config("prompts_32")).data.sources[0].num_samples == 32
    assert RunConfig.from_dict(ab.variant_config("spread_128")).lookahead.offsets[-1] == 124
    codes = RunConfig.from_dict(ab.variant_config("data_codes")).data.sources[0]
    assert codes.tasks == ("ood_train_codes",) and codes.num_samples == 128
    # targets are computed once per (model, data, targets) and shared by the later variants that match
    assert ab.targets_owner("base") == "base" and ab.targets_owner("tokens_8") == "base"
    assert ab.parent_of("tokens_8_kernel_15") == "tokens_8" and ab.parent_of("kernel_15") == "base"
    assert ab.parents_of("tokens_8_codes_ens_2_tail_30") == ("tokens_8_codes", "tokens_8_codes_seed_1")
    assert ab.targets_owner("data_codes") == "data_codes" and ab.targets_owner("tokens_8_codes") == "data_codes"
    # a variant's extra data source is added whole after the base's (merged) one; its seeds share its targets
    multi = RunConfig.from_dict(ab.variant_config("answer_multi_seed_2"))
    assert [s.tasks for s in multi.data.sources] == [("ood_train_codes",), ("ood_train_multi",)]
    assert multi.data.sources[1].num_samples == 64 and multi.targets.teacher == "answer" and multi.train.seed == 2
    assert ab.targets_owner("answer_multi_seed_2") == ab.targets_owner("answer_multi") == "answer_multi"
    assert ab.parent_of("answer_multi_seed_1_tail_30") == "answer_multi_seed_1"
    # a seed group is one recipe at three seeds and nothing else: both parts of the seed (batch order, init) at
    # 0, 1, 2, or one part at 0, 1, 2 and the other at 0
    for group, members in ab.SEED_GROUPS.items():
        cfgs = [RunConfig.from_dict(ab.variant_config(m)) for m in members]
        seeds = [(c.train.seed, c.train.adapter_seed) for c in cfgs]
        if group.endswith("_draws_tail_30"):  # seeds at 0, a different draw of the token ids each
            drawn = [ab.seed_parts(m)[2] for m in members]
            assert seeds == [(0, 0)] * len(members) and len(set(drawn)) == len(members), group
            assert [c.train.init_tokens or tuple(ab.INIT_TOKENS[0]) for c in cfgs] == [
                tuple(ab.INIT_TOKENS[d]) for d in drawn], group
            bare = [dataclasses.replace(c, train=dataclasses.replace(c.train, init_tokens=None)) for c in cfgs]
            assert all(b == bare[0] for b in bare), group
            continue
        assert seeds in ([(0, 0), (1, 1), (2, 2)], [(0, 0), (0, 1), (0, 2)], [(0, 0), (1, 0), (2, 0)]), group
        # a member whose init_tokens are the ids its own seed draws (tokens_8_codes: seed 0's) is the same recipe
        drawn = [c.train.init_tokens if c.train.init_tokens is not None else tuple(ab.INIT_TOKENS.get(
            c.train.adapter_seed, ())) for c in cfgs]
        assert all(d == drawn[0] for d in drawn) or not any(c.train.init_tokens for c in cfgs), group
        unseeded = [dataclasses.replace(c, train=dataclasses.replace(c.train, seed=0, init_seed=None, init_tokens=None))
                    for c in cfgs]
        assert all(u == unseeded[0] for u in unseeded), group
        assert [c.lookahead for c in cfgs] == [cfgs[0].lookahead] * 3, group
    assert RunConfig.from_dict(ab.variant_config("tokens_8_codes_order_2")).train.adapter_seed == 0
    # the seed-parts table names each part's seed from the configs themselves
    assert [ab.seed_parts(n) for n in ("tokens_8_codes_tail_30", "tokens_8_codes_seed_2_tail_30",
                                       "tokens_8_codes_order_1_tail_30", "tokens_8_codes_init_2_tail_30",
                                       "tokens_8_codes_init_1_tokens_0_tail_30", "tokens_8_codes_tokens_1_tail_30",
                                       "tokens_8_codes_tokens_0_seed_2_tail_30")] == [
        (0, 0, 0), (2, 2, 2), (1, 0, 0), (0, 2, 2), (0, 1, 0), (0, 0, 1), (2, 2, 0)]
    assert all(ab.parent_of(n) != n for n in ab.SEED_PARTS)  # each is a trained adapter scored with the tail


def test_validation_loss_holds_out_the_training_prompts():
    """eval/lookahead_ablations/validation_loss.py scores adapters on the training families at another data seed:
    every source redrawn at that seed, the sample count split over the sources, no stored prompt cache, and the
    training seed itself refused."""
    import importlib.util

    path = CONFIGS.parent / "eval" / "lookahead_ablations" / "validation_loss.py"
    spec = importlib.util.spec_from_file_location("validation_loss", path)
    vl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vl)
    cfg = RunConfig.from_dict({"data": {"sources": [{"kind": "synthetic", "tasks": ["ood_train"], "num_samples": 128},
                                                    {"kind": "synthetic", "tasks": ["ood_train_codes"],
                                                     "num_samples": 8, "seed": 3}]},
                               "targets": {"prompt_cache": True}})
    out = vl.held_out(cfg, 1000, 17)
    assert [s.seed for s in out.data.sources] == [1000, 1000]
    assert [s.num_samples for s in out.data.sources] == [9, 8] and not out.targets.prompt_cache
    assert [s.tasks for s in out.data.sources] == [s.tasks for s in cfg.data.sources] and out.lookahead == cfg.lookahead
    with pytest.raises(ValueError, match="training source's seed"):
        vl.held_out(cfg, 3, 16)


def test_train_only_never_scores_the_adapter_an_eval_only_variant_trains_first(tmp_path, monkeypatch):
    """`ablations.py run --train-only` on an eval-only variant trains its missing parent and scores neither."""
    import importlib.util
    import json

    path = CONFIGS.parent / "eval" / "lookahead_ablations" / "ablations.py"
    spec = importlib.util.spec_from_file_location("ablations_run", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    (tmp_path / "here").mkdir()
    monkeypatch.setattr(ab, "HERE", tmp_path / "here")
    calls = []

    def sh(cmd, log):
        calls.append(cmd)
        if "train_lookahead" in cmd:  # a trained adapter: its export (with the config the eval-only copy edits)
            export = pathlib.Path(cmd[cmd.index("--workdir") + 1]) / "export"
            export.mkdir(parents=True)
            (export / "adapter.safetensors").write_bytes(b"")
            (export / "adapter_config.json").write_text(json.dumps({"config": {}}))
        return 1.0

    monkeypatch.setattr(ab, "_sh", sh)
    runs = tmp_path / "runs"
    (runs / "data_codes" / "targets").mkdir(parents=True)
    (runs / "data_codes" / "targets" / "manifest.json").write_text("{}")  # the shared targets exist
    ab.run(["tokens_8_codes_init_1_tail_30"], runs, evaluate=False)
    assert [c[c.index("-m") + 1] for c in calls] == ["train_lookahead"]
    assert "tokens_8_codes_init_1.yaml" in calls[0][calls[0].index("--config") + 1]
    exported = json.loads((runs / "tokens_8_codes_init_1_tail_30" / "export" / "adapter_config.json").read_text())
    assert exported["config"]["tail"] == 30
    assert not (tmp_path / "here" / "results").exists()
