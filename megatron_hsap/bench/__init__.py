"""Benchmarks: the CPU attention benchmark (``python -m megatron_hsap.bench.cpu_attention``), its
executed baselines, and the memory planner (``megatron-hsap memory``)."""
