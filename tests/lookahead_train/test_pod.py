"""The Llama-3.1-8B v5e-16 pod config: one real train step lowers for its 4 x 4 mesh on 16 fake CPU
devices with abstract (ShapeDtypeStruct) weights and their shardings, so a shape or sharding error
fails here rather than on the pod. No weights are materialised."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
POD = REPO / "configs" / "lookahead_llama31_8b_v5e.yaml"


def dry_run(config, tmp_path, devices):
    """The CLI's dry run; devices=None: no fake-device flags, no JAX_PLATFORMS (the CLI sets them up)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    if devices is not None:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "train_lookahead", "--config", str(config), "--workdir",
                           str(tmp_path / "w"), "--dry-run"], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO)


def test_pod_config_lowers_one_train_step_on_its_mesh(tmp_path):
    cfg = yaml.safe_load(POD.read_text())
    devices = cfg["mesh"]["data"] * cfg["mesh"]["model"]
    assert devices == 16  # v5e-16
    out = dry_run(POD, tmp_path, devices)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'data': 4, 'model': 4" in out.stdout


def test_dry_run_makes_its_own_fake_devices(tmp_path):
    """As the README writes it, with no flags: the dry run makes the mesh's 16 CPU devices itself."""
    out = dry_run(POD, tmp_path, None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'data': 4, 'model': 4" in out.stdout
    assert not (tmp_path / "w").exists()  # nothing written


def test_a_bad_pod_mesh_fails_on_cpu(tmp_path):
    cfg = yaml.safe_load(POD.read_text())
    cfg["mesh"] = {"data": 3, "model": 4}  # batch 8 does not split over 3 data replicas
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    out = dry_run(bad, tmp_path, 12)
    assert out.returncode != 0 and "train.batch_size=8" in out.stderr


@pytest.mark.slow
def test_pod_step_compiles_with_weights_sharded_four_ways(tmp_path):
    """XLA compiles the 16-device program (SPMD partitioning included); each device's arguments are
    about a quarter of the 16 GB of bf16 weights, so the model axis really shards them. (CPU memory
    figures for temporaries are not TPU figures: the CPU upcasts bf16 matmuls.)"""
    code = textwrap.dedent(f"""
        import jax
        from train_lookahead import dryrun
        from train_lookahead.config import RunConfig
        from train_lookahead.pipeline import build_mesh
        cfg = RunConfig.from_yaml({str(POD)!r})
        compiled = dryrun.lower_train_step(cfg, dryrun.model_config(cfg), build_mesh(cfg.mesh)).compile()
        print("ARGS", compiled.memory_analysis().argument_size_in_bytes)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=16",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    args = int(out.stdout.split("ARGS")[1].split()[0])
    weights = 8.03e9 * 2  # Llama-3.1-8B parameters in bf16
    assert weights / 4 * 0.9 < args < weights / 4 * 1.2
