"""README.md's examples run as written, so that they cannot rot.

test_python_blocks_run_in_order: every ```python block of README.md, read at test time, runs in order in one
fresh process, as a notebook would (later blocks use the names earlier ones define: `model`, `contexts`,
...), from a directory other than the repository, with max_new_tokens and every other argument as written.
The process has 8 fake CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, as the Sharding
section says to set before jax is imported), so the Sharding block runs in its place and the blocks after it
use its sharded `model`. A block's commented-out alternatives (a comment that is one assignment of a call: the
Quick start's `# model = kvjax.load_model(...)` lines) are evaluated after it, without rebinding the name. After
each block, its check (CHECKS) asserts what the block prints or claims. A failure names the block's section,
README line, first line, the failing statement and the traceback. Cost: about 75 s of CPU in the subprocess,
nearly all of it compiling the programs of its 13 generate / compress calls (`-s` prints each block's wall and
CPU time), plus about 10 s building the tiny models of SUBSTITUTIONS.
What the test changes, and why, is in SUBSTITUTIONS (strings replaced before running) and SKIPPED (blocks
not run; none today); nothing else is changed.

test_commands_parse: every `python -m ...` line of the other ```bash blocks (the first block's install and
test lines are checked by tests/test_ci_commands.py) is parsed by its module's own argument parser (the
parser's `parse_args` is stopped once it returns, so nothing runs), and config files and values are
validated as the command would (`kvjax.eval`: `cli.resolve`; the training commands: their config loaders).
The `python -m <kvjax CLI> ...` commands quoted in the prose are parsed too. A renamed or removed flag, a missing
config or an unknown policy or task fails it. Nothing is run: the `--dry-run` command's lowering is
tests/lookahead_train/test_pod.py's job (same config), the others train or evaluate for minutes to hours.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUNNER = pathlib.Path(__file__).resolve().parent / "readme_runner.py"


@dataclasses.dataclass
class Block:
    lang: str
    heading: str   # the README heading above it ("## Quick start")
    ordinal: int   # its index among the blocks of that language under that heading
    line: int      # README line of its first code line (1-based)
    code: str

    @property
    def key(self) -> tuple[str, int]:
        return self.heading, self.ordinal

    @property
    def title(self) -> str:
        return f"{self.heading} #{self.ordinal}"


def readme_blocks(lang: str) -> list[Block]:
    """The fenced blocks of `lang`, in README order (lines in fences, such as `# comments`, are no headings)."""
    blocks: list[Block] = []
    heading, fence, counts = "(top)", None, {}
    for number, line in enumerate(README.read_text().splitlines(), start=1):
        if fence is None and line.startswith("```"):
            fence = line[3:].strip()
            if fence == lang:
                ordinal = counts[heading] = counts.get(heading, -1) + 1
                blocks.append(Block(lang, heading, ordinal, number + 1, ""))
        elif fence is not None and line.startswith("```"):
            fence = None
        elif fence is None and line.startswith("#"):
            heading = line.strip()
        elif fence == lang:
            blocks[-1].code += line + "\n"
    return blocks


# ---------------------------------------------------------------------------------------------- python blocks

# Strings of the python blocks replaced before they run (each must still occur in the README). Only things a
# test machine cannot have; the replacement is built by the test (fixture `substitutes`).
SUBSTITUTIONS = {
    # a 15 GB Hub download, in a commented-out alternative of the Quick start: a tiny random Qwen2 checkpoint
    # (tests/tiny_models.build_hf) in a local folder, which load_model reads by the same code as a Hub snapshot
    '"Qwen/Qwen2.5-7B-Instruct"': "tiny_qwen2_folder",
    # a placeholder path to a downloaded GGUF file (commented-out alternative of the Quick start): a tiny llama
    # GGUF with Q4_1 weights and a BPE tokenizer and chat template in its metadata (tests/tiny_gguf.write_gguf)
    '"path/to/SmolLM2-135M-Instruct.Q4_1.gguf"': "tiny_q4_1_gguf",
    # the LookaheadKV adapter that `python -m train_lookahead --config configs/lookahead_bundled.yaml --workdir
    # runs/lkv` (the README's next bash block, a training run of many minutes) exports: the shipped adapter
    # kvjax/assets/lookahead, that command's export for the bundled model (same files and format)
    '"runs/lkv/export"': "bundled_adapter_folder",
    # two training seeds' exports of one recipe (the ensemble example): the shipped adapter twice, so the
    # ensemble's mean attention is that adapter's own and its answers must be policy="lookahead_kv"'s
    '"runs/seed_0/export"': "bundled_adapter_folder",
    '"runs/seed_1/export"': "bundled_adapter_folder",
}

# Blocks not run at all, with the reason: none. (Blocks needing a Hub model, a GGUF file or a trained adapter
# run with SUBSTITUTIONS; the Sharding block runs on 8 fake CPU devices.)
SKIPPED: dict[tuple[str, int], str] = {}

# Per block (heading, ordinal): what it prints or claims, checked right after it ran. H[name]: the values a
# top-level statement of the block assigned to `name`, in order; H["_"]: the values of its bare expressions;
# H["alternatives"]: its commented-out alternatives' values; HISTORY: the same over all blocks so far; STDOUT:
# what the block printed. A block without a check fails the test: add one.
CHECKS = {
    ("## Quick start", 0): """
        import numpy as np
        from kvjax.models.model import BUNDLED_MODEL_DIR
        (bundled,) = H["model"]
        assert bundled.path == str(BUNDLED_MODEL_DIR) and bundled.mesh is None, bundled.path
        texts, ids, qa, sampled = H["out"]
        # print(out.texts): one answer per prompt; tokens [B, max_new_tokens], lengths [B]
        assert len(texts.texts) == 2 and all(isinstance(t, str) and t for t in texts.texts), texts.texts
        assert repr(texts.texts) in STDOUT
        assert texts.tokens.shape == (2, 64) and texts.lengths.shape == (2,)
        assert ((texts.lengths > 0) & (texts.lengths <= 64)).all(), texts.lengths
        # token ids: the prompts are the ids themselves
        assert ids.tokens.shape == (2, 16) and ids.prompt_lengths.tolist() == [3, 2], ids.prompt_lengths
        # context-then-question, full cache: every context entry kept
        assert qa.tokens.shape == (2, 32) and qa.budget is None
        ctx = [len(bundled.tokenizer.encode(c)) for c in contexts]
        assert (qa.kept >= np.array(ctx)).all(), (qa.kept, ctx)
        # sampling, stop tokens, chat template: the template adds tokens around the prompt; a row that stops
        # ends with the stop token
        assert sampled.tokens.shape == (1, 32)
        assert sampled.prompt_lengths[0] > len(bundled.tokenizer.encode(prompts[0])), sampled.prompt_lengths
        eos = bundled.tokenizer.eos_token_id
        for row, n in zip(sampled.tokens, sampled.lengths):
            assert n == 32 or row[n - 1] == eos, (row, n)
            assert eos not in row[:n - 1].tolist(), row
        # the commented-out alternatives (a Hub id with dtype, a GGUF file), loaded via SUBSTITUTIONS
        hub, gguf = H["alternatives"]
        assert hub.params["embed"].dtype == np.dtype("bfloat16"), hub.params["embed"].dtype
        assert gguf.tokenizer is not None and gguf.tokenizer.chat_template, "GGUF: no tokenizer / chat template"
    """,
    ("### Sharding", 0): """
        import jax
        assert len(jax.devices()) == 8
        assert dict(mesh.shape) == {"data": 4, "model": 2}, mesh.shape
        assert "model" in tuple(model.params["layers"]["q"].sharding.spec), model.params["layers"]["q"].sharding
        assert out.tokens.shape == (4, 16)
        # the same greedy answers as the Quick start's one-device model
        single = kvjax.generate(HISTORY["model"][0], prompts, max_new_tokens=16)
        assert (out.tokens == single.tokens).all(), (out.tokens, single.tokens)
    """,
    ("## Eviction policies", 0): """
        import numpy as np
        assert {"snapkv", "snapkv_kvpress", "lookahead_kv", "h2o"} <= set(H["_"][0]), H["_"][0]
        ratio, budget, kvpress = H["out"]
        T = ratio.prompt_lengths
        # compression_ratio=0.5 keeps int(T * (1 - r)) entries per head, fewer than the prompt
        assert ratio.kept.tolist() == [int(t * 0.5) for t in T] and (ratio.kept < T).all(), (ratio.kept, T)
        assert ratio.tokens.shape == (2, 64)
        assert budget.kept.tolist() == [64, 64] and (T > 64).all(), budget.kept
        assert kvpress.kept.tolist() == [int(t * 0.5) for t in kvpress.prompt_lengths], kvpress.kept
        # print(out.kept, out.cache_bytes)
        assert str(kvpress.kept) in STDOUT and str(kvpress.cache_bytes) in STDOUT and kvpress.cache_bytes > 0
        # compress: pos / valid [layers, batch, kv_heads, slots]; int(T/2) kept per head, the last 32 (SnapKV's
        # observation window) among them
        (compressed,) = H["cache"]
        valid, pos = np.asarray(compressed.valid), np.asarray(compressed.pos)
        assert valid.shape[:3] == (model.config.num_layers, 2, model.config.num_kv_heads) == pos.shape[:3]
        assert (valid.sum(-1) == np.array([int(t * 0.5) for t in T])[None, :, None]).all()
        for b, t in enumerate(T):
            for kept_pos in pos[:, b][valid[:, b]].reshape(-1, int(t * 0.5)):
                assert set(range(t - 32, t)) <= set(kept_pos.tolist()) and kept_pos.max() < t, kept_pos
    """,
    ("## Eviction policies", 1): """
        explicit, preset = H["out"]
        T = explicit.prompt_lengths
        assert explicit.kept.tolist() == [int(t * 0.5) for t in T] and (explicit.kept < T).all(), explicit.kept
        # with SUBSTITUTIONS the loaded adapter is the bundled model's, which policy="lookahead_kv" uses
        assert type(H["adapter"][0]).__name__ == "Adapter"
        assert (explicit.tokens == preset.tokens).all() and (explicit.kept == preset.kept).all()
    """,
    ("## Eviction policies", 2): """
        import kvjax.lookahead as lk
        (ensemble,) = H["ensemble"]
        assert ensemble.members == 2 and lk.load("runs/ensemble").members == 2
        # two copies of the bundled adapter: the mean of their attention is its own, so are the answers
        (out,) = H["out"]
        preset = HISTORY["out"][-2]
        assert (out.tokens == preset.tokens).all() and (out.kept == preset.kept).all()
    """,
    ("### Chunked prefill", 0): """
        import numpy as np
        (chunked,) = H["out"]
        assert (chunked.prompt_lengths > 2 * 64).all(), chunked.prompt_lengths  # 3 chunks each
        assert chunked.kept.tolist() == [64, 64], chunked.kept
        (compressed,) = H["cache"]
        assert (np.asarray(compressed.valid).sum(-1) == 64).all()
        (settings,) = H["settings"]
        assert settings[0].prefill_chunk == 64 and callable(kvjax.engine.generate_settings)
        presets = H["_"][-1]
        assert {"snapkv", "h2o_prefill", "tova"} <= set(presets) and not {"kvzip", "lookahead_kv"} & set(presets)
    """,
    ("### Quantized KV storage", 0): """
        import numpy as np
        int4, kivi = H["out"]
        assert int4.cache_layout == "quantized" and "quantized" in STDOUT, int4.cache_layout
        assert int4.kept.tolist() == [int(t * 0.5) for t in int4.prompt_lengths], int4.kept
        dense = kvjax.generate(model, contexts, policy="snapkv", compression_ratio=0.5, max_new_tokens=16)
        # 4.25 bits per kept entry against 16, the 16 decoded entries at 16 bits in the window (70-90 kept)
        assert (int4.kv_bytes16_peak < dense.kv_bytes16_peak / 2).all(), (int4.kv_bytes16_peak, dense.kv_bytes16_peak)
        assert kivi.cache_layout == "quantized" and kivi.kept.tolist() == [96, 96], kivi.kept
        assert kivi.tokens.shape == (2, 16)
    """,
    ("### Compilation cache", 0): """
        import os, pathlib
        import jax, jax.numpy as jnp
        folder = pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "kvjax" / "jax"   # set by the test
        assert jax.config.jax_compilation_cache_dir == str(folder), jax.config.jax_compilation_cache_dir
        before = set(folder.rglob("*"))
        jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
        assert set(folder.rglob("*")) - before, f"nothing written to {folder}"
    """,
}


def commented_alternatives(code: str) -> list[str]:
    """Commented-out lines of a block that are one assignment of a call (`# model = kvjax.load_model(...)`)."""
    found = []
    for line in code.splitlines():
        text = re.sub(r"^\s*#\s?", "", line) if line.lstrip().startswith("#") else None
        if text is None:
            continue
        text = re.sub(r"\)\s+#.*$", ")", text)  # a trailing comment
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assign) and isinstance(tree.body[0].value, ast.Call):
            found.append(text)
    return found


@pytest.fixture(scope="module")
def substitutes(tmp_path_factory) -> dict[str, str]:
    from gguf import GGMLQuantizationType

    from tiny_gguf import write_gguf
    from tiny_models import build_hf

    folder = tmp_path_factory.mktemp("readme_models")
    build_hf("qwen2", folder / "qwen2")
    path, _ = write_gguf("llama3", folder, qtype=GGMLQuantizationType.Q4_1, name="SmolLM2-135M-Instruct.Q4_1.gguf")
    return {"tiny_qwen2_folder": repr(str(folder / "qwen2")), "tiny_q4_1_gguf": repr(str(path)),
            "bundled_adapter_folder": repr(str(ROOT / "kvjax" / "assets" / "lookahead"))}


def test_python_blocks_run_in_order(tmp_path, substitutes):
    blocks = readme_blocks("python")
    keys = [b.key for b in blocks]
    assert len(set(keys)) == len(keys) and blocks
    assert not set(SKIPPED) - set(keys), f"SKIPPED names blocks the README no longer has: {set(SKIPPED) - set(keys)}"
    assert not set(CHECKS) - set(keys), f"CHECKS names blocks the README no longer has: {set(CHECKS) - set(keys)}"
    unchecked = [f"{b.title} (line {b.line}): {b.code.splitlines()[0]}" for b in blocks
                 if b.key not in CHECKS and b.key not in SKIPPED]
    assert not unchecked, f"README python blocks without a check in CHECKS (add what they claim): {unchecked}"
    spec, used = [], set()
    for b in blocks:
        if b.key in SKIPPED:
            continue
        code, alternatives = b.code, commented_alternatives(b.code)
        for old, name in SUBSTITUTIONS.items():
            if old in code:
                used.add(old)
                code = code.replace(old, substitutes[name])
                alternatives = [a.replace(old, substitutes[name]) for a in alternatives]
        spec.append({"title": b.title, "line": b.line, "code": code, "alternatives": alternatives,
                     "check": textwrap.dedent(CHECKS[b.key])})
    assert used == set(SUBSTITUTIONS), f"SUBSTITUTIONS not found in README.md: {set(SUBSTITUTIONS) - used}"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "work").mkdir()
    flag = "--xla_force_host_platform_device_count=8"  # what the Sharding section says to set
    assert f"XLA_FLAGS={flag}" in README.read_text()
    xla_flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), flag]))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags,
           "XDG_CACHE_HOME": str(tmp_path / "xdg"),  # the Compilation cache block writes there, not in ~/.cache
           "HF_HUB_OFFLINE": "1",  # no block may reach the Hub
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "spec.json")], cwd=tmp_path / "work",
                          env=env, capture_output=True, text=True, timeout=900)
    report = proc.stderr[proc.stderr.find("README BLOCK FAILED"):] if "README BLOCK FAILED" in proc.stderr \
        else proc.stderr[-4000:]
    if proc.returncode != 0:
        pytest.fail(f"a README python block failed:\n{report[-6000:]}", pytrace=False)
    assert "README BLOCKS OK" in proc.stdout, proc.stdout[-2000:]
    print(proc.stdout.splitlines()[-1])


def test_alternatives_are_found():
    code = '# model = kvjax.load_model("a", dtype="bfloat16")  # a Hub id\n# sampling, stop tokens\nx = 1\n'
    assert commented_alternatives(code) == ['model = kvjax.load_model("a", dtype="bfloat16")']


# ---------------------------------------------------------------------------------------------- bash blocks


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace):
        super().__init__("parsed")
        self.parser, self.namespace = parser, args


def _cli_main(module: str):
    if module == "kvjax.eval":
        from kvjax.eval.cli import main
    elif module == "kvjax.bench":
        from kvjax.bench.__main__ import main
    elif module == "train_lookahead":
        from train_lookahead.__main__ import main
    elif module == "kvjax.training.bundled":
        from kvjax.training.bundled.cli import main
    else:
        raise AssertionError(f"README runs `python -m {module}`: add its entry point to _cli_main")
    return main


def _validate(module: str, parsed: Parsed) -> None:
    """What the command checks before it starts work: config files and values."""
    args = parsed.namespace
    if module == "kvjax.eval":
        from kvjax.eval.cli import resolve

        resolve(args, parsed.parser)  # config file, tasks, policies, ratios (parser.error -> SystemExit)
    elif module == "train_lookahead":
        from train_lookahead.config import RunConfig

        RunConfig.from_yaml(args.config)
    elif module == "kvjax.training.bundled":
        from kvjax.training.bundled.config import load_config

        load_config(args.config)
        if args.init_from:
            load_config(args.init_from_config)


def parse_command(argv: list[str], monkeypatch) -> tuple[str, Parsed | None]:
    """(module, the parsed arguments; None for --help, which exits 0). Raises SystemExit on a bad flag."""
    assert argv[:2] == ["python", "-m"], argv
    module, rest = argv[2], argv[3:]
    original = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise Parsed(self, original(self, args, namespace))

    main = _cli_main(module)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
        try:
            main(rest)
        except Parsed as parsed:
            return module, parsed
        except SystemExit as exit_:
            if exit_.code == 0 and "--help" in rest:
                return module, None
            raise
    raise AssertionError(f"{shlex.join(argv)}: the parser was never called")


CLI_MODULES = ("kvjax.eval", "kvjax.bench", "train_lookahead", "kvjax.training.bundled")


def readme_commands() -> list[list[str]]:
    """`python -m ...` lines of the bash blocks after the first (continuations joined, comments dropped), then the
    `python -m <kvjax CLI> ...` commands quoted in the prose (`python -m kvjax.eval --cache-layout ragged`)."""
    commands = []
    for block in readme_blocks("bash")[1:]:
        for line in block.code.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    modules = "|".join(re.escape(m) for m in CLI_MODULES)
    commands += [shlex.split(c) for c in re.findall(rf"`(python -m (?:{modules})(?: [^`]*)?)`", README.read_text())]
    return commands


def test_commands_parse(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the README's commands run from the repository root (configs/...)
    commands = readme_commands()
    assert len(commands) >= 20, commands
    others = [shlex.join(c) for c in commands if c[:2] != ["python", "-m"]]
    assert not others, f"README bash lines that are not `python -m ...`: check them here too: {others}"
    failures = []
    for argv in commands:
        try:
            module, parsed = parse_command(argv, monkeypatch)
            if parsed is None:
                assert "usage: python -m" in capsys.readouterr().out
            else:
                _validate(module, parsed)
        except (SystemExit, Exception) as err:  # noqa: BLE001 (report every command)
            failures.append(f"{shlex.join(argv)}\n  -> {type(err).__name__}: {err}\n  {capsys.readouterr().err[-800:]}")
    assert not failures, "README commands that do not parse:\n" + "\n".join(failures)
    # the test itself: a misspelled flag, an unknown subcommand and an unknown policy are caught
    for bad, word in ((["--prefill-chunks", "2048"], "--prefill-chunks"),
                      (["--config", "configs/eval_ruler_4k.yaml", "--policies", "snapkw"], "snapkw")):
        with pytest.raises(SystemExit):
            _validate(*parse_command(["python", "-m", "kvjax.eval", *bad], monkeypatch))
        assert word in capsys.readouterr().err
    for bad, word in ((["kvjax.bench", "kernel"], "'kernel'"),
                      (["train_lookahead", "--config", "configs/lookahead_bundled.yaml", "--workdir", "w", "--dryrun"],
                       "--dryrun")):
        with pytest.raises(SystemExit):
            parse_command(["python", "-m", *bad], monkeypatch)
        assert word in capsys.readouterr().err
