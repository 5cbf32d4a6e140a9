"""Load generation for the product commands ``pdserve bench`` and ``pdserve compare``:
workloads and datasets, the OpenAI-compatible endpoint client, SLOs and goodput, and the
comparison report. The planner (planner/) and the benchmarks (bench/) import it; it
imports neither."""
