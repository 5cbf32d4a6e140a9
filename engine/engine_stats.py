"""What an engine holds now and has done so far (``LLMEngine.stats``): the serving
worker's ``stats()`` and metrics read these instead of the engine's parts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot between steps. Invariant: ``free_blocks <= total_blocks``."""

    waiting: int  # requests queued (never run, or preempted)
    running: int
    waiting_for_kv: int  # reservations whose KV is on its way (engine/reservation.py)
    free_blocks: int  # EMPTY and CACHED blocks (engine/block_manager.py)
    total_blocks: int
    cached_blocks: int  # registered in the prefix cache, held or not
    preemptions: int  # running requests preempted so far
    # prompt tokens of first admissions, and those of them the prefix cache held
    queried_tokens: int
    hit_tokens: int
    # prompt tokens whose KV this engine computed (a recomputed prompt counts again)
    computed_prompt_tokens: int
