"""Layouts, head routes, segment plans, the handoff's protobuf form, the checksum: the
pure parts, no transport."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kv_transfer import Handoff, KVDestination, KVLayout, KVLayoutError, get_transport
from pdserve.kv_transfer.gloo_wire import layer_spans
from pdserve.kv_transfer.routes import all_routes, routes_from, routes_into
from pdserve.kv_transfer.segment import Segment, checksum, gather, is_run, plan_positions, scatter
from tests.kv_transfer.helpers import SECRET


def test_layout_head_ranges():
    lay = KVLayout(2, 16, 8, 64, "float32", tp_size=4, tp_rank=2)
    assert lay.heads_per_rank == 2
    assert lay.head_range == (4, 6)
    assert lay.cache_shape(10) == (2, 2, 10, 16, 2, 64)
    assert lay.block_bytes() == 16 * 2 * 64 * 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_kv_heads=3, tp_size=2), ["num_kv_heads=3", "tensor_parallel=2"]),
        (dict(tp_rank=4, tp_size=4), ["tp_rank=4"]),
        (dict(dtype="int8"), ["dtype='int8'"]),
        (dict(block_size=0), ["block_size=0"]),
    ],
)
def test_layout_rejects_with_the_value(kwargs, words):
    base = dict(num_layers=2, block_size=16, num_kv_heads=4, head_dim=8)
    with pytest.raises(KVLayoutError) as e:
        KVLayout(**{**base, **kwargs})
    for w in words:
        assert w in str(e.value)


def test_pools_with_different_block_sizes_refuse():
    prefill = KVLayout(2, 16, 4, 8)
    decode = KVLayout(2, 32, 4, 8, tp_size=2)
    with pytest.raises(KVLayoutError, match="block_size=16.*block_size=32"):
        prefill.check_compatible(decode)
    prefill.check_compatible(KVLayout(2, 16, 4, 8, tp_size=4))  # tp may differ


@pytest.mark.parametrize("src_tp, dst_tp", list(itertools.product((1, 2, 4), repeat=2)))
def test_routes_cover_every_head_once(src_tp, dst_tp):
    heads = 4
    routes = all_routes(heads, src_tp, dst_tp)
    seen = []
    for r in routes:
        s0 = r.src_rank * heads // src_tp
        d0 = r.dst_rank * heads // dst_tp
        assert r.src_heads == (r.heads[0] - s0, r.heads[1] - s0)
        assert r.dst_heads == (r.heads[0] - d0, r.heads[1] - d0)
        seen += range(*r.heads)
    assert sorted(seen) == list(range(heads))
    # each side computes its own share from its layout alone, and they agree
    for s in range(src_tp):
        lay = KVLayout(1, 4, heads, 8, tp_size=src_tp, tp_rank=s)
        assert routes_from(lay, dst_tp) == [r for r in routes if r.src_rank == s]
    for d in range(dst_tp):
        lay = KVLayout(1, 4, heads, 8, tp_size=dst_tp, tp_rank=d)
        assert routes_into(lay, src_tp) == [r for r in routes if r.dst_rank == d]


def test_routes_refuse_indivisible_heads():
    with pytest.raises(KVLayoutError, match="tensor_parallel=3"):
        all_routes(4, 1, 3)


def test_segment_plan_keeps_runs_and_groups_strays():
    ids = [9, 2, 3, 4, 5, 6, 11, 0, 20, 21]
    plan = plan_positions(ids, max_blocks=3, min_run=4)
    covered = [i for start, count in plan for i in range(start, start + count)]
    assert covered == list(range(len(ids)))
    assert all(count <= 3 for _, count in plan)
    runs = [(start, n) for start, n in plan if n > 1 and is_run(ids[start : start + n])]
    assert runs[:2] == [(1, 3), (4, 2)]  # the run 2..6, cut at 3


def _gathered(src, ids, heads):
    out = torch.empty(*src.shape[:-4], len(ids), *src.shape[-3:-2], heads[1] - heads[0],
                      src.shape[-1], dtype=src.dtype)  # fmt: skip
    return gather(src, ids, heads, out)


def test_gather_scatter_between_different_block_ids():
    torch.manual_seed(0)
    src = torch.randn(12, 4, 4, 8)
    dst = torch.zeros(12, 4, 4, 8)
    src_ids, dst_ids = [3, 4, 5, 9], [0, 7, 8, 2]
    for heads in ((0, 4), (1, 3)):
        data = _gathered(src, src_ids, heads)
        assert data.is_contiguous() and data.shape == (4, 4, heads[1] - heads[0], 8)
        scatter(dst, dst_ids, heads, data)
        assert torch.equal(
            dst[dst_ids][:, :, heads[0] : heads[1]], src[src_ids][:, :, slice(*heads)]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_scatter_several_layers_at_once(dtype):
    """K and V of consecutive layers in one copy (``[layers, 2, blocks, ...]``, how the
    gloo backend fills and empties a pack), 2-byte dtypes and head slices included."""
    torch.manual_seed(0)
    src = torch.randn(5, 2, 12, 4, 4, 8).to(dtype)
    dst = torch.zeros_like(src)
    for src_ids, dst_ids in (([3, 4, 5, 9], [0, 7, 8, 2]), ([3, 4, 5, 6], [7, 8, 9, 10])):
        for heads in ((0, 4), (1, 3)):
            data = _gathered(src[1:4], src_ids, heads)
            assert data.is_contiguous()
            assert data.shape == (3, 2, len(src_ids), 4, heads[1] - heads[0], 8)
            scatter(dst[1:4], dst_ids, heads, data)
            h = slice(*heads)
            assert torch.equal(dst[1:4, :, dst_ids][..., h, :], src[1:4, :, src_ids][..., h, :])
    assert not dst[0].any() and not dst[4].any()


def test_pack_spans_group_consecutive_layers():
    n = 96  # bytes of K (and V) of each packed row: (segment, offset, n)

    def row(layer, start, count, offset, nbytes):
        return Segment(layer, start, count, (0, 2)), offset, nbytes

    rows = [row(0, 0, 2, 0, n), row(1, 0, 2, 2 * n, n), row(2, 0, 2, 4 * n, n)]
    rows += [row(3, 2, 1, 6 * n, n // 2), row(5, 2, 1, 7 * n, n // 2)]  # a layer skipped
    rows += [row(6, 2, 1, 9 * n, n // 2)]  # not right after the previous row in the pack
    assert layer_spans(rows, 2) == [(0, 3), (3, 4), (4, 5), (5, 6)]


def test_destination_and_handoff_round_trip_through_protobuf():
    dst_layout = KVLayout(3, 4, 4, 8, "bfloat16", tp_size=4)
    dst = KVDestination(["10.0.0.1:5000", "a:1", "b:2", "c:3"], [2, 3, 0], dst_layout, "grpc")
    assert KVDestination.from_bytes(dst.to_bytes()) == dst
    h = Handoff(42, {"prefill_start": 1.5}, "prefill-3")
    back = Handoff.from_bytes(h.to_bytes())
    assert back == h and back.phase_times == h.phase_times and back.first_logprob is None
    # the first token's logprobs (float32 values: exact through protobuf's float)
    values = torch.tensor([-0.1, -2.5, -7.25]).tolist()
    h = Handoff(42, {}, "prefill-3", values[0], (42, 7, 250), tuple(values))
    assert Handoff.from_bytes(h.to_bytes()) == h
    with pytest.raises(ValueError, match="2 top_ids and 1 top_logprobs"):
        Handoff(42, {}, "", -0.5, (1, 2), (-0.5,))
    with pytest.raises(KVLayoutError, match="2 addresses for a decode pool of tensor_parallel=4"):
        KVDestination(["a:1", "b:2"], [1], dst_layout)


def test_checksum_sees_a_flipped_bit_and_ignores_alignment():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.uint8)[123] ^= 4
    assert checksum(t) != checksum(flipped)
    raw = torch.randn(3000).view(torch.uint8)
    assert checksum(raw[8:808]) == checksum(raw[8:808].clone())
    assert checksum(raw[4:804]) == checksum(raw[4:804].clone())  # unaligned view


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="kv_transfer.backend='ucx'"):
        get_transport("ucx")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_refuses_host_memory_by_name():
    tr = get_transport("nccl")
    lay = KVLayout(2, 4, 4, 8)
    with pytest.raises(KVLayoutError, match="nccl backend needs a cuda cache"):
        tr.receiver(lay, torch.zeros(lay.cache_shape(4)), secret=SECRET)
    sender = tr.sender(lay, secret=SECRET)
    dst = KVDestination(["127.0.0.1:1"], [0], lay, "nccl", "t")
    cache = torch.zeros(lay.cache_shape(4))
    with pytest.raises(KVLayoutError, match="the nccl backend sends cuda tensors"):
        sender.send_all("t", cache, [1], dst)
    sender.close()
