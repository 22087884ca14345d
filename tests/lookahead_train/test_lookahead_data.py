"""train_lookahead's data: seeds disjoint from the eval's, local files, offline HF error, and a
deterministic grain pipeline whose saved iterator state resumes exactly."""

import json
import sys

import numpy as np
import pytest

from kvjax.data.base import encode, sample_rng
from kvjax.data.prompts import build_prompt
from kvjax.eval.engine import BUNDLED_MODEL_DIR
from kvjax.eval.tasks import generate_task
from kvjax.models.model import load_tokenizer
from train_lookahead.config import DataSection, SourceSection
from train_lookahead.data import SEED_OFFSET, prompt_dataset, prompt_source, synthetic_seed, to_example, train_dataset

TASKS = ("niah_single_1", "vt")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL_DIR)


def test_training_seeds_are_disjoint_from_the_eval(tokenizer):
    # the eval draws sample i of a task with sample_rng(seed, task, i), seeds small (42 by default)
    train_seeds = [synthetic_seed(s, k) for s in range(3) for k in range(50)]
    assert min(train_seeds) >= SEED_OFFSET and len(set(train_seeds)) == len(train_seeds)
    for task in TASKS:
        eval_draws = {sample_rng(seed, task, i).random() for seed in range(100) for i in range(200)}
        train_draws = {sample_rng(seed, task, 0).random() for seed in train_seeds}
        assert not eval_draws & train_draws
    # and the prompts themselves differ from the eval's (default seed 42, first samples)
    data = DataSection(sources=(SourceSection(tasks=TASKS, context_length=400, num_samples=8),), max_prompt_tokens=400)
    train_prompts = {tuple(r["tokens"]) for r in prompt_dataset(data, tokenizer)}
    for task in TASKS:
        for s in generate_task(task, tokenizer, 400, 4, seed=42):
            assert tuple(encode(tokenizer, build_prompt(s, tokenizer, query_aware=True).text)) not in train_prompts


def test_synthetic_prompts_are_deterministic_and_cycle_tasks(tokenizer):
    data = DataSection(sources=(SourceSection(tasks=TASKS, context_length=400, num_samples=4),), max_prompt_tokens=400)
    a, b = prompt_dataset(data, tokenizer), prompt_dataset(data, tokenizer)
    assert [r["id"].split("/")[0] for r in a] == ["niah_single_1", "vt", "niah_single_1", "vt"]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert a[0]["tokens"] != a[2]["tokens"]
    assert all(len(r["tokens"]) <= 400 for r in a)


def test_query_agnostic_synthetic_prompts_are_the_contexts_alone(tokenizer):
    """query_aware: false renders the part the question-agnostic eval compresses: the same sample's tokens
    up to the question, and none of the question's."""
    src = dict(tasks=TASKS, context_length=400, num_samples=2)
    aware = prompt_dataset(DataSection(sources=(SourceSection(**src),), max_prompt_tokens=400), tokenizer)
    agnostic = prompt_dataset(DataSection(sources=(SourceSection(**src, query_aware=False),), max_prompt_tokens=400),
                              tokenizer)
    for i, task in enumerate(TASKS):
        (sample,) = generate_task(task, tokenizer, 400, 1, seed=synthetic_seed(0, 0))
        parts = build_prompt(sample, tokenizer, query_aware=False)
        assert agnostic[i]["tokens"] == encode(tokenizer, parts.compressed)
        n = len(agnostic[i]["tokens"])
        assert len(aware[i]["tokens"]) > n and sample["question"] not in tokenizer.decode(agnostic[i]["tokens"])
        # every record knows its context: the agnostic prompt's tokens, the leading ones of the full prompt
        records = [src[i] for src in (prompt_source(DataSection(sources=(SourceSection(**src, query_aware=q),)),
                                                    tokenizer) for q in (True, False))]
        c = records[0]["context_tokens"]
        assert records[1]["context_tokens"] == n and n - 2 <= c <= n
        assert aware[i]["tokens"][:c] == agnostic[i]["tokens"][:c]


def test_records_carry_the_reference_answer_for_the_answer_teacher(tmp_path, tokenizer):
    """A query-aware synthetic record's "answer" is its sample's reference continuation (after the answer prefix
    the prompt ends with); a context-only record has none; file rows keep an "answer" / "answer_tokens" field."""
    src = dict(tasks=("records_recall", "niah_single_1"), context_length=600, num_samples=2)
    aware = prompt_source(DataSection(sources=(SourceSection(**src),)), tokenizer)
    agnostic = prompt_source(DataSection(sources=(SourceSection(**src, query_aware=False),)), tokenizer)
    for i, task in enumerate(src["tasks"]):
        (sample,) = generate_task(task, tokenizer, 600, 1, seed=synthetic_seed(0, 0))
        assert aware[i]["text"].endswith(sample["answer_prefix"])
        assert aware[i]["answer"].strip().startswith(sample["answers"][0])
        assert all(a in aware[i]["answer"] for a in sample["answers"]) and "answer" not in agnostic[i]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2 =", "answer": " 4"}) + "\n" + json.dumps({"tokens": [5, 6]}) + "\n")
    rows = prompt_source(DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),)), tokenizer)
    assert rows[0]["answer"] == " 4" and "answer" not in rows[1]


def test_file_sources(tmp_path, tokenizer):
    rows = [{"prompt": "What is the capital of France?"},
            {"messages": [{"role": "user", "content": "Hi there"}]},
            {"tokens": [5, 6, 7]}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "What is the capital of France?"}]), tmp_path / "p.parquet")
    data = DataSection(sources=(SourceSection(kind="jsonl", path=str(jsonl)),
                                SourceSection(kind="parquet", path=str(tmp_path / "p.parquet"))))
    ds = prompt_dataset(data, tokenizer)
    assert len(ds) == 4
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    expected = tokenizer.encode(chat, add_special_tokens=False)
    assert ds[0]["tokens"] == expected and ds[3]["tokens"] == expected
    hi = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                       add_generation_prompt=True)
    assert ds[1]["tokens"] == tokenizer.encode(hi, add_special_tokens=False)
    assert ds[2]["tokens"] == [5, 6, 7]
    plain = DataSection(sources=data.sources[:1], chat_template=False)
    assert prompt_dataset(plain, tokenizer)[0]["tokens"] == tokenizer.encode(
        tokenizer.bos_token + "What is the capital of France?", add_special_tokens=False)


@pytest.mark.parametrize("row, words", [({"prompt": "a", "tokens": [1]}, ["exactly one", "prompt", "tokens"]),
                                        ({"text": "a"}, ["exactly one", "'text'"])])
def test_bad_rows_are_clear_errors(tmp_path, row, words):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError) as e:
        prompt_dataset(DataSection(sources=(SourceSection(kind="jsonl", path=str(path)),)), None)
    assert all(w in str(e.value) for w in words) and "p.jsonl:1" in str(e.value)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        prompt_dataset(DataSection(sources=(SourceSection(kind="jsonl", path=str(tmp_path / "missing.jsonl")),)), None)


def test_hf_source_offline_is_a_clear_error(monkeypatch):
    data = DataSection(sources=(SourceSection(kind="hf", name="org/some-prompts"),))
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        prompt_dataset(data, None)

    class Offline:
        @staticmethod
        def load_dataset(*args, **kwargs):
            raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", Offline)
    with pytest.raises(RuntimeError, match="org/some-prompts.*offline"):
        prompt_dataset(data, None)


def _records(n=10, L=2, H=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(3, 9))
        out.append({"tokens": np.full(t, i, np.int32), "target": rng.random((L, H, t)).astype(np.float32)})
    return out


def test_to_example_pads_without_truncating():
    r = _records(1)[0]
    n = len(r["tokens"])
    ex = to_example(r, 12)
    assert ex["tokens"].shape == (12,) and (ex["tokens"][:n] == r["tokens"]).all() and (ex["tokens"][n:] == 0).all()
    assert (ex["positions"] == np.where(np.arange(12) < n, np.arange(12), -1)).all()
    np.testing.assert_array_equal(ex["target"][..., :n], r["target"])
    assert (ex["target"][..., n:] == 0).all()
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        to_example(r, n - 1)


def test_train_batches_cover_each_epoch_and_resume_from_saved_state():
    records = _records(10)
    ds = train_dataset(records, batch_size=2, seed=7, max_prompt_tokens=8)
    it = iter(ds)
    batches = [next(it) for _ in range(10)]
    assert batches[0]["target"].shape == (2, 2, 3, 8)  # [L, B, Hq, T]
    epoch = [int(b["tokens"][r, 0]) for b in batches[:5] for r in range(2)]
    assert sorted(epoch) == list(range(10))  # one epoch = a permutation of the records
    epoch2 = [int(b["tokens"][r, 0]) for b in batches[5:] for r in range(2)]
    assert sorted(epoch2) == list(range(10)) and epoch2 != epoch  # reshuffled
    row = int(batches[0]["tokens"][0, 0])
    np.testing.assert_array_equal(batches[0]["target"][:, 0, :, : len(records[row]["tokens"])], records[row]["target"])
    # a fresh iterator set to the state saved after 3 batches yields batches 4.. exactly
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    resumed = iter(train_dataset(records, batch_size=2, seed=7, max_prompt_tokens=8))
    resumed.set_state(state)
    for b in batches[3:]:
        got = next(resumed)
        for k in b:
            np.testing.assert_array_equal(got[k], b[k])


def test_processes_split_the_global_batch():
    records = _records(12)
    one = next(iter(train_dataset(records, batch_size=4, seed=1, max_prompt_tokens=8)))["tokens"][:, 0]
    parts = [next(iter(train_dataset(records, batch_size=4, seed=1, max_prompt_tokens=8, process_index=p,
                                     process_count=2)))["tokens"][:, 0] for p in range(2)]
    assert sorted(np.concatenate(parts).tolist()) == sorted(one.tolist())
    with pytest.raises(ValueError, match="train.batch_size=3"):
        train_dataset(records, batch_size=3, seed=1, max_prompt_tokens=8, process_count=2)
