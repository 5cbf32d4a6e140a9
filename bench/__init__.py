"""Benchmarks, workloads, SLOs and goodput (later: the simulator and the planner)."""
