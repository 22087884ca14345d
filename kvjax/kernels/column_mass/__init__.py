"""Column mass (H2O prefill): reference.py (XLA), pallas_tpu.py, pallas_gpu.py, api.py."""
