"""Decode attention with probabilities: reference.py (XLA), pallas_tpu.py, pallas_gpu.py, api.py."""
