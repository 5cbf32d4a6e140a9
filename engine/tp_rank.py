"""Ranks 1..N-1 of a tensor-parallel engine.

``RankEngine`` holds one rank's shard of the weights and of the KV cache and runs the
forward passes rank 0 broadcasts (engine/step_plan.py) until rank 0 stops it; it never
schedules or samples. ``LocalRanks`` starts them as local processes for the offline
``LLM(..., tensor_parallel=N)``; the cluster runs them as Ray actors (``RankActor``,
and the pools' subclasses that add their share of the KV transfer).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_view import KVView
from pdserve.engine.llm_engine import load_model
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel import TensorParallel, serve_store
from pdserve.engine.step_plan import StepPlan

StepHook = Callable[[StepPlan], tuple[Callable[[int], None] | None, Callable[[], None] | None]]


class RankEngine:
    def __init__(self, model: str, config: EngineConfig, tp: TensorParallel):
        _, self.model = load_model(model, config, tp)
        self.tp, self.device = tp, torch.device(config.device)
        # no request's table: rank 0 schedules; this one sizes the cache
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.runner = ModelRunner(self.model, self.blocks, config.seed)

    def kv_view(self) -> KVView:
        """This rank's cache, for its share of the KV transfer (engine/kv_view.py)."""
        return KVView(self.runner, self.blocks)

    def serve(self, around: StepHook | None = None) -> int:
        """Run broadcast steps until rank 0 stops; returns how many ran. ``around(plan)``
        (for plans with ``extra``) gives a per-layer callback for the pass and a function
        to call after it (the serving worker's KV sends)."""
        steps = 0
        cache, axis = self.runner.kv_cache, self.runner.block_axis  # for rank 0's copies
        while (plan := StepPlan.receive(self.tp, self.device, cache, axis)) is not None:
            on_layer, after = around(plan) if around is not None and plan.extra else (None, None)
            self.runner.execute(plan, on_layer)
            if after is not None:
                after()
            steps += 1
        return steps


def _rank_main(
    model: str, fields: dict, rank: int, size: int, address: str, secret: bytes, threads: int
):
    """A spawned rank's process: ``fields`` are rank 0's ``EngineConfig``'s, as a dict."""
    torch.set_num_threads(threads)
    config = EngineConfig(**fields)
    if config.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    tp = TensorParallel.join(address, rank, size, secret, config.device)
    RankEngine(model, config, tp).serve()


class LocalRanks:
    """Ranks 1..size-1 as local processes (spawned), and rank 0's ``TensorParallel``."""

    def __init__(self, model: str, config: EngineConfig, size: int, threads: int):
        secret = secrets.token_bytes(32)  # this world's own: its ranks get it as arguments
        self.rendezvous, address = serve_store(secret)
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(model, asdict(config), rank, size, address, secret, threads),
                name=f"pdserve-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
        self._wait_started(size)
        self.tp = TensorParallel.join(address, 0, size, secret, config.device)

    def _wait_started(self, size: int) -> None:
        """Until every rank reached the store; a rank that died first is an error here,
        not a hang in the group's formation."""
        keys = [f"up/{r}" for r in range(1, size)]
        while not self.rendezvous.store.check(keys):
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead:
                self.join(timeout_s=0)
                raise RuntimeError(
                    f"tensor-parallel rank process {dead[0].name} exited with code "
                    f"{dead[0].exitcode} before joining (its traceback is above)"
                )
            time.sleep(0.05)

    def join(self, timeout_s: float = 30.0) -> None:
        """Wait for the ranks to leave (after ``LLMEngine.close``); kill stragglers."""
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        self.rendezvous.close()


def threads_per_rank(size: int) -> int:
    """Torch threads per rank: this process's CPUs shared evenly (at least one each, so
    a degree above the CPU count oversubscribes them)."""
    return max(1, len(os.sched_getaffinity(0)) // size)
