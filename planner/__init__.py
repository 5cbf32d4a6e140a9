"""Per-phase parallelism planning (DistServe §4 as a tool): a roofline or profiled cost
model, a discrete-event simulator of co-located and disaggregated clusters, and a
placement search that writes a config ``pdserve up`` accepts. ``docs/planner.md``."""
