"""kvjax.enable_compilation_cache: a second process reads what the first compiled; the eval CLI's option."""

import json
import os
import pathlib
import subprocess
import sys

import kvjax
from kvjax.compilation_cache import default_cache_dir
from kvjax.eval.cli import build_parser, compilation_cache_setting

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One small jitted program in a fresh process; prints the cache events jax reported and the files.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import kvjax
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
folder = kvjax.enable_compilation_cache(sys.argv[1], min_compile_time_secs=0)
jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(jnp.ones((8, 8))).block_until_ready()
print(json.dumps({"hits": sum(e.endswith("/cache_hits") for e in events),
                  "misses": sum(e.endswith("/cache_misses") for e in events), "folder": str(folder)}))
"""


def _run(folder):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_cache(tmp_path):
    folder = tmp_path / "jax_cache"
    first = _run(folder)
    assert first["folder"] == str(folder) and first["misses"] >= 1 and first["hits"] == 0
    files = sorted(p.name for p in folder.iterdir())
    assert files
    second = _run(folder)
    assert second["hits"] >= 1 and second["misses"] == 0
    assert sorted(p.name for p in folder.iterdir()) == files  # nothing compiled again


def test_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "kvjax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "kvjax" / "jax"
    assert callable(kvjax.enable_compilation_cache)


def test_eval_option():
    parser = build_parser()
    assert parser.parse_args([]).compilation_cache is None  # the default folder
    assert parser.parse_args(["--compilation-cache", "off"]).compilation_cache == "off"
    assert parser.parse_args(["--compilation-cache", "/tmp/x"]).compilation_cache == "/tmp/x"


def test_eval_option_falls_back_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVJAX_COMPILATION_CACHE", "off")
    assert compilation_cache_setting(None) == "off"
    assert compilation_cache_setting(str(tmp_path)) == str(tmp_path)  # the option wins
    monkeypatch.setenv("KVJAX_COMPILATION_CACHE", str(tmp_path))
    assert compilation_cache_setting(None) == str(tmp_path)
    monkeypatch.delenv("KVJAX_COMPILATION_CACHE")
    assert compilation_cache_setting(None) is None  # enable_compilation_cache's default folder
