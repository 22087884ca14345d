"""README.md's Quick start and Sharding examples run as written (max_new_tokens made small), from a
directory other than the repository, so that the examples cannot rot."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(heading: str) -> list[str]:
    """The ```python blocks of the README section `heading`, up to the next heading of any level
    (lines inside code fences, such as `# comments`, are not headings)."""
    blocks: list[str] = []
    inside, fence, found = False, None, False
    for line in README.read_text().splitlines():
        if fence is None and line.startswith("#"):
            if inside:
                break
            inside = found = line.strip() == heading
            continue
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            if fence == "python" and inside:
                blocks.append("")
            continue
        if inside and fence == "python":
            blocks[-1] += line + "\n"
    assert found, f"README.md has no section {heading!r}"
    assert blocks, f"README.md section {heading!r} has no python example"
    return blocks


def run_example(code: str, tmp_path: pathlib.Path, env: dict[str, str] | None = None) -> str:
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=3", code)
    script = tmp_path / "example.py"
    script.write_text(code)
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"README example failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_quick_start_runs_as_written(tmp_path):
    code = "\n".join(python_blocks("## Quick start"))
    assert 'kvjax.load_model("bundled")' in code
    check = textwrap.dedent("""
        from kvjax.models.model import BUNDLED_MODEL_DIR
        assert model.path == str(BUNDLED_MODEL_DIR), model.path
        assert out.tokens.shape == (len(prompts), 3) and len(out.texts) == len(prompts)
        assert all(0 < n <= 3 for n in out.lengths.tolist())
        print("QUICK START OK")
    """)
    assert "QUICK START OK" in run_example(code + check, tmp_path)


def test_sharding_runs_on_8_cpu_devices(tmp_path):
    code = "\n".join(python_blocks("### Sharding"))
    flag = "--xla_force_host_platform_device_count=8"
    assert flag in README.read_text()
    check = textwrap.dedent("""
        import jax
        assert len(jax.devices()) == 8
        assert "model" in tuple(model.params["layers"]["q"].sharding.spec)
        single = kvjax.generate(kvjax.load_model("bundled"), prompts, max_new_tokens=3)
        assert (out.tokens == single.tokens).all(), (out.tokens, single.tokens)
        print("SHARDING OK")
    """)
    out = run_example(code + check, tmp_path, env={"XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"})
    assert "SHARDING OK" in out
