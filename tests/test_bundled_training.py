"""The bundled model's training data (rows, needle drills, curriculum) and its loss."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.data.prompts import build_prompt, encode_prompt
from kvjax.data.targets import completion
from kvjax.models.export import init_params
from kvjax.models import extend
from kvjax.training import bundled

DATA = {"suite": "default", "lengths": [512, 768], "curriculum": [[3, [256], 5]], "drill_fraction": 0.6,
        "task_weights": {"niah_multikey_2": 2}, "batch_size": 4, "seed": 123}


@pytest.fixture(scope="module")
def tokenizer():
    return bundled.load_tokenizer()


@pytest.fixture(scope="module")
def batches(tokenizer):
    return bundled.TaskBatches(DATA, tokenizer)


def test_curriculum_stages_and_purity(batches):
    assert batches.stage(0) == ([256], 5) and batches.stage(3) == ([512, 768], 4)
    a, b = batches(1), batches(1)
    assert a["tokens"].shape == (5, 256) and batches(5)["tokens"].shape == (4, 768)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert batches.tasks[512].count("niah_multikey_2") == 2 and "niah_multikey_3" not in batches.tasks[256]


def test_rows_open_with_the_evaluation_prompt_and_its_answer(batches, tokenizer):
    """Row = the task sample rendered as the evaluation renders it, then its canonical answer."""
    for step in (0, 3, 4):
        for i in range(batches.stage(step)[1]):
            ids, targets = batches.sample(step, i)
            length = batches.length_at(step)
            assert len(ids) <= length and targets and targets[-1] < len(ids)
            first = targets[0]
            prompt = ids[:first]
            text = tokenizer.decode(prompt)
            assert text.startswith(tokenizer.bos_token + "<|user|>\n") and text.endswith(
                ("provided text is", "provided text are", "they are: "))
            answer_end = ids.index(tokenizer.eos_token_id, first)
            assert targets[: answer_end - first + 1] == list(range(first, answer_end + 1))


def test_drill_answers_are_what_the_context_says(batches, tokenizer):
    """Every extra question asks about needles of the row's own context, and its target is
    exactly the values that context gives that key (all of them, in order of appearance)."""
    drilled = 0
    for step in range(3, 15):
        for i in range(batches.stage(step)[1]):
            ids, targets = batches.sample(step, i)
            text = tokenizer.decode(ids)
            turns = text.split("<|end|>\n<|user|>\n")
            facts = {}
            for kind, key, value in bundled.NEEDLE.findall(turns[0]):
                facts.setdefault(key, []).append(value)
            for turn in turns[1:]:
                reply = turn.split("<|assistant|>\n")[1]
                m = re.fullmatch(r" The .+ for (.+) mentioned in the provided text (?:is|are) (.+)\.(?:<\|end\|>)?", reply)
                keys = re.split(r", and |, ", m.group(1))
                assert m.group(2).split(", ") == [v for k in keys for v in facts[k]]
                drilled += 1
            # targets are the answers' tokens and end tokens, nothing of the questions
            n_turns = len(turns)
            assert sum(ids[t] == tokenizer.eos_token_id for t in targets) == n_turns
    assert drilled >= 10


def test_needle_drills_use_ruler_templates():
    sample = {"context": "x One of the special magic numbers for red-fox is: 1234567. y\n"
                         "One of the special magic numbers for blue-cat is: 7654321.\n"
                         "One of the special magic numbers for red-fox is: 1111111.",
              "answer_prefix": " The special magic number for blue-cat mentioned in the provided text is"}
    import random

    drills = bundled.needle_drills(sample, random.Random(0))
    by_keys = {d[3]: d for d in drills}
    if ("red-fox",) in by_keys:  # two values: the plural form
        q, prefix, answer, _ = by_keys[("red-fox",)]
        assert q == "What are all the special magic numbers for red-fox mentioned in the provided text?"
        assert answer == " 1234567, 1111111."
    assert bundled.query_keys(sample) == ["blue-cat"]
    single = bundled.needle_drills({"context": sample["context"].split("\n")[1]}, random.Random(0))
    assert single == [("What is the special magic number for blue-cat mentioned in the provided text?",
                       " The special magic number for blue-cat mentioned in the provided text is", " 7654321.",
                       ("blue-cat",))]


def test_drills_on_several_keys_list_values_in_the_order_asked():
    """order="query": key by key, as asked; order="context": by order of appearance, as `render`
    lists a sample's own answers."""
    import random

    keys = ["red-fox", "blue-cat", "old-owl", "tall-elm", "wet-sand"]
    values = [str(1_000_000 + 111_111 * j) for j in range(5)]
    context = "\n".join(f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values))
    where = {v: context.find(v) for v in values}
    grouped = 0
    for seed in range(40):
        for order in ("query", "context"):
            for _, _, answer, asked in bundled.needle_drills({"context": context}, random.Random(seed), order):
                said = answer.strip(" .").split(", ")
                by_key = [values[keys.index(k)] for k in asked]
                assert said == (by_key if order == "query" else sorted(by_key, key=where.get))
                grouped += len(asked) > 1 and by_key != sorted(by_key, key=where.get)
    assert grouped >= 4
    with pytest.raises(ValueError, match="drill_order"):
        bundled.TaskBatches({**DATA, "drill_order": "random"}, bundled.load_tokenizer())


def test_render_matches_the_evaluation_split(tokenizer):
    from kvjax.eval.tasks import generate_task

    s = generate_task("niah_multivalue", tokenizer, 512, 1, seed=5)[0]
    prompt, answer = bundled.render(s, tokenizer)
    ctx, q = encode_prompt(build_prompt(s, tokenizer), tokenizer)
    assert prompt == ctx + q
    assert answer[-1] == tokenizer.eos_token_id
    values = tokenizer.decode(answer[:-1]).strip(" .").split(", ")
    assert sorted(values) == sorted(s["answers"]) and completion(s) != ""
    assert values == sorted(values, key=s["context"].find)  # order of appearance


def test_lm_loss_against_a_numpy_reference(batches, tokenizer):
    cfg = bundled.model_config({"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                                "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 1024,
                                "rope_theta": 10000.0, "tie_embeddings": True}, tokenizer)
    params = init_params(cfg, jax.random.PRNGKey(0))
    batch = batches(0)
    logits, _, _ = extend(params, cfg, None, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), fresh=True)
    logp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    B = logp.shape[0]
    ans, ctx = [], []
    for b in range(B):
        n = int((batch["positions"][b] >= 0).sum())
        tgt = set()
        for j in range(int(batch["weights"][b].sum())):
            p = batch["target_index"][b, j]
            ans.append(-logp[b, p, batch["targets"][b, j]])
            tgt.add(p)
        ctx += [-logp[b, p, batch["tokens"][b, p + 1]] for p in range(n - 1) if p not in tgt]
    for w in (0.0, 0.5):
        loss, m = bundled.lm_loss(params, None, {k: jnp.asarray(v) for k, v in batch.items()}, cfg=cfg,
                                  context_weight=w)
        np.testing.assert_allclose(float(loss), np.mean(ans) + w * np.mean(ctx), rtol=2e-5)
        np.testing.assert_allclose(float(m["answer_loss"]), np.mean(ans), rtol=2e-5)


def test_copy_and_recall_rows(batches, tokenizer):
    """Copy rows: the reply is the user's list token for token. Recall rows: the reply states each
    needle's value again (by its key), every fact exactly once; both fit the row and target the reply."""
    for index in range(6):
        ids, targets = batches._copy_row(256, index)
        assert len(ids) <= 256 and targets == list(range(targets[0], len(ids)))
        reply = ids[targets[0]: -1]
        text = tokenizer.decode(ids[: targets[0]])
        assert text.startswith(tokenizer.bos_token + "<|user|>\n" + bundled.COPY_INSTRUCTION)
        assert tokenizer.decode(reply) in text and len(reply) > 80

        ids, targets = batches._recall_row(384, index)
        assert len(ids) <= 384 and targets == list(range(targets[0], len(ids)))
        facts = dict((k, v) for _, k, v in bundled.NEEDLE.findall(tokenizer.decode(ids[: targets[0]])))
        said = tokenizer.decode(ids[targets[0]: -1])
        stated = re.findall(r"for (\S+)(?: mentioned in the provided text)? is:? (\d+)\.", said)
        assert len(facts) >= 4 and sorted(stated) == sorted(facts.items())


def test_recall_rows_with_uuids(tokenizer):
    """`recall.uuids`: those rows state UUID values (word or UUID keys), and a row's reply still
    gives every fact of its context exactly once; rows of configs without it are unchanged."""
    plain = bundled.TaskBatches(DATA, tokenizer)
    mixed = bundled.TaskBatches({**DATA, "recall": {"share": 1.0, "uuids": 0.5}}, tokenizer)
    uuid = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
    kinds = set()
    for index in range(12):
        ids, targets = mixed._recall_row(512, index)
        context, said = tokenizer.decode(ids[: targets[0]]), tokenizer.decode(ids[targets[0]: -1])
        facts = dict((k, v) for _, k, v in bundled.NEEDLE.findall(context))
        stated = re.findall(r"for (\S+)(?: mentioned in the provided text)? is:? (\S+)\.", said)
        assert len(facts) >= 2 and sorted(stated) == sorted(facts.items())
        if all(re.fullmatch(uuid, v) for v in facts.values()):
            kinds.add("uuid keys" if all(re.fullmatch(uuid, k) for k in facts) else "word keys")
        else:
            assert all(v.isdigit() for v in facts.values())
            kinds.add("numbers")
            assert (ids, targets) == plain._recall_row(512, index)
    assert kinds == {"uuid keys", "word keys", "numbers"}


@pytest.mark.slow
def test_phased_training_resumes_exports_and_refuses_an_unfinished_earlier_phase(tmp_path):
    import yaml

    conf = {"model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                      "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 512, "rope_theta": 10000.0,
                      "tie_embeddings": True},
            "data": {**DATA, "lengths": [256], "curriculum": [], "batch_size": 2},
            "optim": {"steps": 2, "learning_rate": 1e-3},
            "train": {"checkpoint_every": 1, "log_every": 1, "context_weight": 0.5}}
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(yaml.safe_dump(conf))
    second.write_text(yaml.safe_dump({**conf, "optim": {"steps": 3, "learning_rate": 1e-3}}))
    a, b = tmp_path / "a", tmp_path / "b"
    bundled.main(["--config", str(first), "--workdir", str(a), "--max-minutes", "0"])  # interrupted after 1 step
    with pytest.raises(ValueError, match="finish that run first"):
        bundled.main(["--config", str(second), "--workdir", str(b), "--init-from", str(a),
                      "--init-from-config", str(first)])
    bundled.main(["--config", str(first), "--workdir", str(a)])  # resumes to its 2 steps
    bundled.main(["--config", str(second), "--workdir", str(b), "--init-from", str(a), "--init-from-config", str(first)])
    out = tmp_path / "model"
    bundled.main(["--config", str(second), "--workdir", str(b), "--export", str(out)])
    card = (out / "MODEL_CARD.md").read_text()
    assert "--init-from runs/bundled" in card and str(first) in card and (out / "loss_curve.png").is_file()
    # a third phase from the second: the card names all three runs, the log steps run on across phases
    c = tmp_path / "c"
    bundled.main(["--config", str(first), "--workdir", str(c), "--init-from", str(b), "--init-from-config", str(second)])
    bundled.main(["--config", str(first), "--workdir", str(c), "--export", str(out)])
    card = (out / "MODEL_CARD.md").read_text()
    assert "--workdir runs/bundled_3 --init-from runs/bundled_2" in card and "(3 steps)" in card
    phases = bundled._chain(json.loads((c / "init_from.json").read_text()))
    assert [(p["workdir"], p["step"]) for p in phases] == [(str(a), 2), (str(b), 3)]
    import kvjax

    model = kvjax.load_model(out)
    assert model.config.num_layers == 1 and model.tokenizer is not None


def test_recall_rows_with_several_values_per_key(tokenizer):
    """`recall.multi_value`: some keys have 2-4 needle lines; the reply states each key once with all
    of its values, in their order of appearance, and no other key or value."""
    batches = bundled.TaskBatches({**DATA, "recall": {"share": 1.0, "multi_value": 0.5}}, tokenizer)
    grouped = 0
    for index in range(12):
        ids, targets = batches._recall_row(768, index)
        context, said = tokenizer.decode(ids[: targets[0]]), tokenizer.decode(ids[targets[0]: -1])
        values: dict[str, list[str]] = {}
        for _, k, v in bundled.NEEDLE.findall(context):
            values.setdefault(k, []).append(v)
        if "mentioned in the provided text" in said:
            stated = {k: vs.split(", ") for k, vs in
                      re.findall(r"for (\S+) mentioned in the provided text (?:is|are) ([\d, ]+)\.", said)}
        else:
            stated = {}
            for _, k, v in bundled.NEEDLE.findall(said):
                stated.setdefault(k, []).append(v)
        assert stated == values
        grouped += sum(len(vs) > 1 for vs in values.values())
    assert grouped >= 5


def _vt_chains_of(context: str) -> dict[str, list[str]]:
    """value -> the names assigned it, in chain order, read off the context's VAR lines."""
    heads = dict((v, n) for n, v in re.findall(r"VAR (\w+) = (\d+)", context))
    follows = dict(re.findall(r"VAR (\w+) = VAR (\w+)", context))
    child = {src: dst for dst, src in follows.items()}
    chains = {}
    for value, name in heads.items():
        chains[value] = [name]
        while chains[value][-1] in child:
            chains[value].append(child[chains[value][-1]])
    return chains


def test_vt_rows_with_more_chains_ask_each_one(tokenizer):
    """`vt_chains`: the vt context gains that many chains, each asked about after the answer with
    RULER's question; every reply names exactly that chain's variables, in order; other rows are untouched."""
    data = {**DATA, "lengths": [1024], "curriculum": [], "task_weights": {"vt": 3}}
    plain, more = bundled.TaskBatches(data, tokenizer), bundled.TaskBatches({**data, "vt_chains": 3}, tokenizer)
    asked = 0
    for i in range(12):
        task = more.tasks[1024][i % len(more.tasks[1024])]
        ids, targets = more.sample(0, i)
        if task != "vt" or "Memorize and track" not in tokenizer.decode(ids):
            assert (ids, targets) == plain.sample(0, i)
            continue
        text = tokenizer.decode(ids)
        start = text.rindex("Memorize and track")  # after the one-shot example
        context = text[start: text.index("Question:", start)]
        chains = _vt_chains_of(context)
        assert len(chains) == 4 and all(len(names) == 5 for names in chains.values())
        questions = re.findall(r"assigned the value (\d+) in the text above", text[start:])
        replies = tokenizer.decode([ids[t] for t in targets]).split(tokenizer.eos_token)[:-1]
        assert len(questions) == len(replies) >= 3
        for value, reply in zip(questions, replies):
            assert reply == " ".join(chains[value])
        assert ids[targets[0] - 1] == tokenizer.encode(" ", add_special_tokens=False)[0]  # the prefix's trailing space
        asked += len(replies) - 1
    assert asked >= 6


@pytest.mark.parametrize("name", ["bundled_model", "bundled_model_long", "bundled_model_3", "bundled_model_4"])
def test_configs_parse_into_typed_fields(name):
    """Each shipped config reads as attributes equal to its YAML values (defaults where a key is absent)."""
    import pathlib

    import yaml

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    conf = bundled.load_config(path)
    d, r = conf.data, raw["data"]
    assert (d.suite, list(d.lengths), d.batch_size, d.seed) == (r["suite"], r["lengths"], r["batch_size"], r["seed"])
    assert [[c.until, list(c.lengths), c.batch_size] for c in d.curriculum] == [
        [c[0], c[1], c[2] if len(c) > 2 else r["batch_size"]] for c in r.get("curriculum", [])]
    assert d.recall.share == r.get("recall", {}).get("share", 0) and d.vt_chains == r.get("vt_chains", 0)
    assert d.more_recall.fraction == r.get("more_recall", {}).get("fraction", 0)
    assert d.drill_order == r.get("drill_order", "query") and d.task_weights == r.get("task_weights", {})
    assert conf.optim.steps == raw["optim"]["steps"] and conf.optim.learning_rate == raw["optim"]["learning_rate"]
    assert conf.train.context_weight == raw["train"]["context_weight"] and conf.model.num_kv_heads == 2
    longer = conf.with_steps(7)
    assert longer.optim.steps == 7 and longer.raw["optim"]["steps"] == 7 and conf.raw["optim"]["steps"] != 7


def test_config_errors_name_the_key_and_the_accepted_ones(tmp_path):
    import yaml

    good = {"model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                      "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 512, "rope_theta": 1e4,
                      "tie_embeddings": True},
            "data": dict(DATA), "optim": {"steps": 2}, "train": {"checkpoint_every": 1, "log_every": 1}}
    bundled.BundledConfig.from_dict(good)
    cases = [({**good, "trian": {}}, r"unknown key\(s\) \['trian'\] in the config; accepted keys: \['data'"),
             ({**good, "data": {**DATA, "copy_fractoin": 0.3}}, r"\['copy_fractoin'\] in data; accepted keys: .*copy_fraction"),
             ({**good, "data": {**DATA, "recall": {"shares": 1}}}, r"\['shares'\] in data\.recall; accepted keys: .*share"),
             ({**good, "optim": {"steps": 2, "lr": 1e-3}}, r"\['lr'\] in optim; accepted keys: .*learning_rate"),
             ({**good, "train": {"log_every": 1}}, r"missing key\(s\) \['checkpoint_every'\] in train")]
    for conf, match in cases:
        with pytest.raises(ValueError, match=match):
            bundled.BundledConfig.from_dict(conf)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cases[1][0]))
    with pytest.raises(ValueError, match=f"{path}: unknown key"):
        bundled.load_config(path)


def test_batches_from_a_data_config_equal_those_from_its_mapping(tokenizer, batches):
    typed = bundled.TaskBatches(bundled.DataConfig.from_dict(DATA), tokenizer)
    for step in (0, 4):
        a, b = typed(step), batches(step)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
