"""`python -m kvjax.eval`: long-context benchmarks (RULER, needle grid, LongBench, math, fidelity)
for KV-cache eviction policies, with resume, a summary table and plots."""
