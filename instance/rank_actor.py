"""Rank r > 0 of a tensor-parallel serving instance as a Ray actor (the engine side of
such a rank is ``engine.tp_rank.RankEngine``): one class for every role, holding the
role's ``RankPart`` (instance/rank_part.py; decode_worker/decode_rank.py,
prefill_worker/prefill_rank.py), or none co-located. No Ray import at module level: the
cluster wraps it."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from pdserve.engine import EngineConfig
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.tp_rank import RankEngine
from pdserve.instance.rank_part import RankPart


class RankActor:
    """Rank r > 0 of a tensor-parallel instance as a Ray actor: the broadcast steps run
    on a thread of its own. Rank 0 (the instance's worker) holds the handles and calls
    the rank's part of the KV transfer (``expect``, ``release``), which hooks the steps
    that carry ``extra`` (``RankPart.around``, see ``RankEngine.serve``)."""

    def __init__(
        self,
        name: str,
        model: str,
        engine_config: dict,
        num_threads: int,
        parallel: dict,
        *,
        part: type[RankPart] | None = None,
        kv: dict | None = None,
    ):
        """``part``: the role's part, made with ``kv`` (the KV transfer's configuration,
        which a rank with a part needs); None: a co-located instance's rank."""
        if part is not None and kv is None:
            raise ValueError(f"kv=None: the part {part.__name__} of {name!r} needs the KV config")
        torch.set_num_threads(max(1, num_threads))
        self.name = name
        self._leader: Any = None  # rank 0's actor handle, looked up on first use (``leader``)
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
        self.part = None if part is None else part(self, kv or {})
        self._calls = {} if self.part is None else self.part.calls()
        around = None if self.part is None else self.part.around
        self._loop = threading.Thread(
            target=self.engine.serve, args=(around,), name=f"{name}-steps", daemon=True
        )
        self._loop.start()

    def ready(self) -> dict:
        """Its name, and its process id (for the chaos tool's signals); its part's facts."""
        facts = {"name": self.name, "pid": os.getpid()}
        return facts if self.part is None else {**facts, **self.part.ready()}

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        src_tp: int,
        token: str,
        sender: str,
        layer_skip: list[int],
    ) -> None:
        """Expect rank 0's reservation (the receiving part's: decode_worker/decode_rank.py)."""
        self._part_call("expect", transfer_id, block_ids, src_tp, token, sender, layer_skip)

    def release(self, transfer_id: str) -> None:
        """Take the transfer out of this rank's receiver (the receiving part's)."""
        self._part_call("release", transfer_id)

    def _part_call(self, call: str, *args: Any) -> Any:
        serve = self._calls.get(call)
        if serve is None:
            what = "no part" if self.part is None else type(self.part).__name__
            raise ValueError(f"{self.name}: call {call!r} is not served by this rank ({what})")
        return serve(*args)

    def ping(self) -> dict:
        """Liveness for the supervisor: answered by any live, unstopped process (rank 0's
        ``ping`` covers the steps this rank runs)."""
        return {"pid": os.getpid(), "busy_s": 0.0}

    def leader(self):
        """Rank 0's actor handle, for pushing it this rank's results: the instance's
        worker, named as this rank without its ``-rank<r>`` suffix."""
        if self._leader is None:
            import ray

            self._leader = ray.get_actor(self.name.rsplit("-rank", 1)[0])
        return self._leader
