"""Benchmarks: scripts that measure one part (kernels, engine, transfer, router, peers,
chaos). The product commands' load generation is loadgen/, the planner planner/."""
