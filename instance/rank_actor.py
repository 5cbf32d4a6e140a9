"""Rank r > 0 of a tensor-parallel serving instance as a Ray actor (the engine side of
such a rank is ``engine.tp_rank.RankEngine``): the pools' rank actors subclass it
(decode_worker/decode_rank.py, prefill_worker/prefill_rank.py). No Ray import at module
level: the cluster wraps it."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from engine import EngineConfig
from engine.parallel import TensorParallel
from engine.tp_rank import RankEngine, StepHook


class RankActor:
    """Rank r > 0 of a tensor-parallel instance as a Ray actor: the broadcast steps run
    on a thread of its own. Rank 0 (the instance's worker) holds the handles and calls
    the pools' subclasses for their part of the KV transfer; ``_setup`` builds it and
    ``_around(plan)`` hooks the steps that carry ``extra`` (see ``RankEngine.serve``)."""

    _around: StepHook | None = None

    def __init__(
        self, name: str, model: str, engine_config: dict, num_threads: int, parallel: dict, *setup
    ):
        torch.set_num_threads(max(1, num_threads))
        self.name = name
        config = EngineConfig(**engine_config)
        tp = TensorParallel.join(
            parallel["address"],
            parallel["rank"],
            parallel["size"],
            parallel["secret"],
            config.device,
        )
        self.engine = RankEngine(model, config, tp)
        self.engine.model.pack_panels()
        self._setup(*setup)
        self._loop = threading.Thread(
            target=self.engine.serve, args=(self._around,), name=f"{name}-steps", daemon=True
        )
        self._loop.start()

    def _setup(self, *setup: Any) -> None:
        """A pool's own state (its KV endpoint), before the steps start: ``setup`` is
        the constructor's, whatever the pool takes (none here)."""

    def ready(self) -> dict:
        """Its name, and its process id (for the chaos tool's signals)."""
        return {"name": self.name, "pid": os.getpid()}

    def ping(self) -> dict:
        """Liveness for the supervisor: answered by any live, unstopped process (rank 0's
        ``ping`` covers the steps this rank runs)."""
        return {"pid": os.getpid(), "busy_s": 0.0}

    def leader(self):
        """Rank 0's actor handle, for pushing it this rank's results: the instance's
        worker, named as this rank without its ``-rank<r>`` suffix."""
        if getattr(self, "_leader", None) is None:
            import ray

            self._leader = ray.get_actor(self.name.rsplit("-rank", 1)[0])
        return self._leader
