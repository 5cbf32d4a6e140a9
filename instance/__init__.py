"""The serving instance around an engine (docs/architecture.md, ``instance/``): the
worker and its step loop, the inbox and the update feed, the messages between router and
instance, the step and cache logs, the rank actor of a tensor-parallel instance, and
the bases of what a role adds to them (``Component``, ``RankPart``). Every pool runs
one; both pools import it, never each other."""
