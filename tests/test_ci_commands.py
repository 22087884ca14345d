"""The test commands the README documents are the ones the CI scripts run."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]


def _pytest_line(script: str) -> str:
    lines = [ln.strip() for ln in (REPO / ".ci" / script).read_text().splitlines()
             if ln.strip().startswith("python -m pytest")]
    assert len(lines) == 1, script
    return lines[0]


def test_fast_and_slow_commands_match_the_readme():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    assert _pytest_line("run") in first_block.splitlines()
    slow = _pytest_line("run_slow").replace(' "$@"', "")
    assert f"`{slow}`" in readme and "`.ci/run_slow`" in readme
    # the two selections split the suite: slow tests in one, the rest in the other
    assert '-m "not slow and not tpu_only and not gpu_only"' in _pytest_line("run")
    assert '-m "slow and not tpu_only and not gpu_only"' in slow
    assert ".ci/run_slow" in (REPO / "setup.cfg").read_text()
