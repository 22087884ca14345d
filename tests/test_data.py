"""kvjax.data: the synthetic task generators (their layering is checked in test_layering.py)."""

import pytest

import kvjax.data as data
from kvjax.eval import tasks


@pytest.fixture(scope="module")
def tok():
    from kvjax.tokenizer import load_bundled_tokenizer

    return load_bundled_tokenizer()


def test_eval_registry_builds_on_the_data_generators(tok):
    assert list(tasks.TASKS)[:len(data.GENERATORS)] == list(data.GENERATORS)
    assert all(tasks.SUITES[s] == data.SUITES[s] for s in data.SUITES)
    for name, gen in data.GENERATORS.items():
        assert tasks.TASKS[name].builder is gen.builder
    a = data.generate("niah_multikey_1", tok, 512, 2, seed=3, overhead=4)
    b = tasks.generate_task("niah_multikey_1", tok, 512, 2, seed=3, overhead=4)
    assert a == b and all(s["length"] <= 512 for s in a)


def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid suites: default, ruler, synthetic"):
        data.suite_tasks("longbench")
    with pytest.raises(ValueError, match="valid tasks: niah_single_1"):
        data.generate("gsm8k", None, 512, 1)
    with pytest.raises(data.TaskSkipped, match="needs a tokenizer"):
        data.generate("vt", None, 512, 1)
