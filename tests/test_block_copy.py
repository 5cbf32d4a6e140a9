"""Rank 0's blocks copied into the other ranks' caches between steps (``StepPlan.
copy_blocks``, how a replicated MLA latent that landed on decode rank 0 alone reaches the
others): two ranks of a real gloo tensor-parallel world in two threads; after the copy
the copied blocks hold rank 0's bytes on rank 1, every other block of rank 1 is as it
was, and the step that follows is received intact."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.parallel import TensorParallel, serve_store
from pdserve.engine.step_plan import StepPlan

IDS = [7, 2, 3, 11]  # a stray, a run, another stray
BLOCKS = 16


def _plan() -> StepPlan:
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
        block_tables=torch.tensor([[3]], dtype=torch.int32),
        slot_mapping=torch.tensor([52], dtype=torch.int64),
        num_decodes=1,
        max_query_len=1,
        max_seq_len=5,
        query_lens_host=[1],
        seq_lens_host=[5],
    )
    return StepPlan(torch.tensor([42]), torch.tensor([4]), meta, [0])


def _two_ranks(rank0, rank1) -> list:
    """``rank0(tp)`` here and ``rank1(tp)`` on a thread, one gloo world of 2; their results."""
    secret = secrets.token_bytes(32)
    store, address = serve_store(secret)
    results: list = [None, None]

    def other():
        results[1] = rank1(TensorParallel.join(address, 1, 2, secret))

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    results[0] = rank0(TensorParallel.join(address, 0, 2, secret))
    thread.join(timeout=30)
    assert not thread.is_alive(), "rank 1 did not finish"
    store.close()
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shape, axis, dtype",
    [
        ((3, BLOCKS, 4, 24), 1, torch.bfloat16),  # a latent row [layers, blocks, bs, width]
        ((2, 2, BLOCKS, 4, 2, 8), 2, torch.float32),  # K/V [layers, 2, blocks, bs, heads, dim]
    ],
    ids=["latent", "kv"],
)
def test_copied_blocks_equal_rank0s_and_nothing_else_changes(shape, axis, dtype):
    g = torch.Generator().manual_seed(3)
    source = torch.randn(shape, generator=g).to(dtype)
    before = torch.full(shape, 7.0, dtype=dtype)
    target = before.clone()

    def rank0(tp):
        StepPlan.copy_blocks(tp, source, axis, IDS)
        StepPlan.copy_blocks(tp, source, axis, [])  # nothing to copy: nothing sent
        _plan().broadcast(tp)
        StepPlan.stop(tp)

    def rank1(tp):
        plan = StepPlan.receive(tp, torch.device("cpu"), target, axis)
        return plan, StepPlan.receive(tp, torch.device("cpu"), target, axis)

    _, (plan, stop) = _two_ranks(rank0, rank1)
    ids = torch.tensor(IDS)
    got, want = target.index_select(axis, ids), source.index_select(axis, ids)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    others = torch.tensor([b for b in range(BLOCKS) if b not in IDS])
    assert torch.equal(target.index_select(axis, others), before.index_select(axis, others))
    assert plan is not None and plan.input_ids.tolist() == [42] and plan.rows == [0]
    assert plan.meta.slot_mapping.tolist() == [52] and stop is None
