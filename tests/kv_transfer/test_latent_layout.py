"""Latent and tied caches (MLA, GLA, GTA) in the transport's pure parts: the layout's
checks, shapes and serialized form, and the routes between tensor-parallel degrees
(every decode rank's row, byte for byte, from exactly one route; the RoPE key once per
decode rank; a replicated row once per decode instance, prefill rank 0 to decode rank 0,
which forwards it to its other ranks; the routes' bytes equal to ``transfer_bytes``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kv_transfer import KVDestination, KVLayout, KVLayoutError
from pdserve.kv_transfer.routes import routes, routes_from, routes_into
from tests.kv_transfer.helpers import layout, reference, shard

# model-wide latent heads, their width, the RoPE width (tiny; the transport is shape-blind)
MLA = {"heads": 1, "dim": 16, "rope": 8, "replicated": True}
GLA4 = {"heads": 4, "dim": 16, "rope": 8, "replicated": False}
COMBOS = list(itertools.product((1, 2, 4), repeat=2))


def lat(tp=1, rank=0, spec=GLA4, **kw) -> KVLayout:
    return layout(tp, rank, latent=spec, **kw)


def test_latent_shapes_and_units():
    g = lat(tp=2, rank=1)  # GLA-4 at TP 2: latent heads 2 and 3, then the RoPE key
    assert (g.heads_per_rank, g.head_range, g.parts, g.unit_dim) == (2, (2, 4), 1, 1)
    assert g.units == 4 * 16 + 8 and g.units_per_rank == 2 * 16 + 8
    assert g.cache_shape(10) == (3, 10, 4, 2 * 16 + 8)
    assert g.block_bytes() == 4 * (2 * 16 + 8) * 4
    assert g.local((32, 64)) == (0, 32) and g.local((64, 72)) == (32, 40)
    m = lat(tp=4, rank=3, spec=MLA)  # MLA: every rank holds the whole row
    assert (m.heads_per_rank, m.head_range, m.units_per_rank) == (1, (0, 1), 24)
    assert m.local((0, 24)) == (0, 24) and m.cache_shape(5) == (3, 5, 4, 24)
    cache = torch.zeros(m.cache_shape(5))
    view = m.unit_view(cache)
    assert view.shape == (3, 1, 5, 4, 24, 1) and view.data_ptr() == cache.data_ptr()
    m.check_cache(cache)
    with pytest.raises(KVLayoutError, match=r"\(3, 5, 4, 25\).*= \(3, 5, 4, 24\)"):
        m.check_cache(torch.zeros(3, 5, 4, 25))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kind="mla"), ["kind='mla'", "'kv', 'latent'"]),
        (dict(kind="latent", rope_dim=0), ["rope_dim=0", "positive integer", "'latent'"]),
        (dict(rope_dim=64), ["rope_dim=64", "allowed 0 for kind 'kv'"]),
        (dict(rope_dim=-1), ["rope_dim=-1", "allowed 0 for kind 'kv'"]),
        (dict(kind="latent", rope_dim=-8), ["rope_dim=-8", "positive integer"]),
        (dict(replicated=True), ["replicated=True", "False for 'kv'"]),
        (dict(kind="latent", rope_dim=8, num_kv_heads=3, tp_size=2),
         ["num_kv_heads=3", "tensor_parallel=2", "latent heads"]),
    ],
)  # fmt: skip
def test_latent_layout_rejects_with_the_value(kwargs, words):
    base = dict(num_layers=2, block_size=16, num_kv_heads=4, head_dim=8)
    with pytest.raises(KVLayoutError) as e:
        KVLayout(**{**base, **kwargs})
    for w in words:
        assert w in str(e.value)


def test_replicated_latent_needs_no_divisible_head_count():
    assert lat(tp=4, rank=2, spec=MLA).head_range == (0, 1)
    assert lat(tp=4, rank=2, spec={**GLA4, "heads": 2, "replicated": True}).heads_per_rank == 2


@pytest.mark.parametrize(
    "other, field",
    [
        (layout(), "kind"),
        (lat(spec={**GLA4, "rope": 4}), "rope_dim"),
        (lat(spec={**GLA4, "replicated": True}), "replicated"),
        (lat(spec={**GLA4, "dim": 32}), "head_dim"),
    ],
)
def test_pools_with_different_latent_layouts_refuse(other, field):
    with pytest.raises(KVLayoutError, match=f"differ in {field}: this pool has {field}="):
        lat().check_compatible(other)
    lat(tp=2).check_compatible(lat(tp=4, rank=3))  # tp may differ


@pytest.mark.parametrize("spec", [MLA, GLA4])
def test_latent_layout_round_trips_through_protobuf(spec):
    lay = lat(tp=4, rank=3, spec=spec, dtype="bfloat16")
    assert KVLayout.from_proto(lay.to_proto()) == lay
    dst = KVDestination(["a:1", "b:2", "c:3", "d:4"], [5, 2], lay, "grpc", "t", cached_blocks=1)
    assert KVDestination.from_bytes(dst.to_bytes()) == dst
    msg = layout().to_proto()
    msg.ClearField("kind")  # a layout without the field is a KV one
    assert KVLayout.from_proto(msg) == layout()


def _route_bytes(spec: dict, src_tp: int, dst_tp: int) -> None:
    """Copy every route of ``spec`` from real prefill shards into empty decode rows and
    check each decode rank's row against its shard of the reference, every column
    written exactly once (a replicated row: on decode rank 0, then forwarded from there
    to the other decode ranks, as the receiving component does, decode_worker/receiving.py)."""
    full = reference(lat(spec=spec), 3, seed=5)  # [layers, blocks, block_size, units]
    src = [shard(full, lat(src_tp, s, spec)) for s in range(src_tp)]
    rs = routes(lat(spec=spec), src_tp, dst_tp)
    forwarded = None  # decode rank 0's row
    for d in range(dst_tp):
        want = shard(full, lat(dst_tp, d, spec))
        got, writes = torch.full_like(want, float("nan")), torch.zeros(want.shape[-1])
        if spec["replicated"] and d > 0:  # nothing over the wire: rank 0's forwarded row
            assert not [r for r in rs if r.dst_rank == d]
            got, writes = forwarded.clone(), torch.ones(want.shape[-1])
        for r in (r for r in rs if r.dst_rank == d):
            (a, b), (c, e) = r.src_heads, r.dst_heads
            assert b - a == e - c == r.num_heads
            assert torch.equal(src[r.src_rank][..., a:b], full[..., r.heads[0] : r.heads[1]])
            got[..., c:e] = src[r.src_rank][..., a:b]
            writes[c:e] += 1
        assert writes.eq(1).all(), f"decode rank {d}: columns written {writes.tolist()}"
        assert torch.equal(got, want), f"decode rank {d} differs"
        forwarded = got if d == 0 else forwarded


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
@pytest.mark.parametrize("spec", [MLA, GLA4], ids=["mla", "gla4"])
def test_latent_routes_cover_every_row_once(spec, src_tp, dst_tp):
    _route_bytes(spec, src_tp, dst_tp)
    rs = routes(lat(spec=spec), src_tp, dst_tp)
    rope = (spec["heads"] * spec["dim"], spec["heads"] * spec["dim"] + spec["rope"])
    senders = [r.src_rank for r in rs if r.heads[1] == rope[1]]  # who sends each RoPE key
    if spec["replicated"]:  # one whole row per decode instance: prefill 0 -> decode 0
        assert [(r.src_rank, r.dst_rank, r.heads) for r in rs] == [(0, 0, (0, rope[1]))]
    else:  # the RoPE key from the prefill rank holding the decode rank's first head
        assert sorted(r.dst_rank for r in rs if r.heads[1] == rope[1]) == list(range(dst_tp))
        per_src, per_dst = spec["heads"] // src_tp, spec["heads"] // dst_tp
        assert senders == sorted(d * per_dst // per_src for d in range(dst_tp))
    # the bytes the routes carry are the layout's formula
    lay, blocks = lat(spec=spec), 7
    carried = sum(blocks * lay.block_bytes(r.num_heads) for r in rs) * lay.num_layers
    assert carried == lay.transfer_bytes(blocks, dst_tp)
    # each side computes its own share from its layout alone, and they agree
    for s in range(src_tp):
        assert routes_from(lat(src_tp, s, spec), dst_tp) == [r for r in rs if r.src_rank == s]
    for d in range(dst_tp):
        assert routes_into(lat(dst_tp, d, spec), src_tp) == [r for r in rs if r.dst_rank == d]


def test_transfer_bytes_formula():
    """For n blocks: sharded L n bs (Hc Dc + Td Dr) e, replicated L n bs (Hc Dc + Dr) e
    whatever Td, KV 2 L n bs H D e (a DeepSeek-V3-shaped MLA row: 512 + 64 in bf16)."""
    mla = {"heads": 1, "dim": 512, "rope": 64, "replicated": True}
    lay = lat(spec=mla, dtype="bfloat16")
    assert lay.transfer_bytes(10, 4) == lay.transfer_bytes(10, 1) == 3 * 10 * 4 * (512 + 64) * 2
    assert lat(spec=GLA4).transfer_bytes(10, 2) == 3 * 10 * 4 * (4 * 16 + 2 * 8) * 4
    assert layout().transfer_bytes(10, 4) == 2 * 3 * 10 * 4 * 4 * 8 * 4
