"""bench/kv_bytes.py's table against hand-computed bytes, and its timing part on tiny cells."""

from dataclasses import replace

import pytest

from pdserve.bench.kv_bytes import (
    VARIANTS,
    bytes_per_token_per_device,
    format_table,
    measured_lines,
    paper_bytes_per_token_per_device,
    paper_transfer_bytes,
    table,
    transfer_bytes,
)
from pdserve.bench.kv_decode_time import latent_decode_ops, report, time_grouped
from pdserve.bench.kv_measured import measure_handoff

L, B = 61, 2  # layers, bf16 bytes


def test_table_at_tp2_by_hand():
    rows = {r.variant: r for r in table(tps=(2,), tokens=1024)}
    # a rank's elements per token per layer at TP 2: MHA 64 heads x 128 x (K, V); GQA-8
    # 4 heads; MLA its whole 512 latent + 64 RoPE; GTA-8 4 tied heads of 128 + 64;
    # GLA-2 one 256 latent head + 64; GLA-4 two + 64
    per_rank = {
        "MHA": 2 * 64 * 128,
        "GQA-8": 2 * 4 * 128,
        "MLA": 512 + 64,
        "GTA-8": 4 * 128 + 64,
        "GLA-2": 256 + 64,
        "GLA-4": 2 * 256 + 64,
    }
    # sent for 1024 tokens to a TP-2 decode instance: per-head K/V once; a latent row to
    # each of the 2 decode ranks, MLA's replicated one once (decode rank 0 forwards it)
    sent = {
        "MHA": 2 * 128 * 128,
        "GQA-8": 2 * 8 * 128,
        "MLA": per_rank["MLA"],
        **{k: 2 * v for k, v in per_rank.items() if k not in ("MHA", "GQA-8", "MLA")},
    }
    assert set(rows) == set(per_rank)
    for name, r in rows.items():
        assert r.per_device == L * B * per_rank[name], name
        assert r.transfer == 1024 * L * B * sent[name], name
        assert r.per_device_paper == r.per_device and r.transfer_paper == r.transfer, name
        assert r.source == "layout"
    assert rows["MLA"].per_device_vs_mha == (512 + 64) / (2 * 64 * 128)
    assert rows["GLA-2"].per_device_vs_mha == 320 / 16384
    assert rows["GTA-8"].transfer_vs_mha == 2 * 576 / (2 * 128 * 128)
    assert rows["GQA-8"].transfer_vs_mha == 1 / 16
    # GLA-2 at TP 4: the engine does not shard 2 latent heads over 4 ranks; the paper's
    # formula duplicates each (D = 2): one 256 head + 64 a rank
    [gla2] = [r for r in table(tps=(4,)) if r.variant == "GLA-2"]
    assert gla2.per_device is None and gla2.transfer is None and "do not shard" in gla2.source
    assert gla2.per_device_paper == L * B * (256 + 64)
    assert gla2.transfer_paper == 4 * 1024 * L * B * (256 + 64)
    lines = format_table(list(rows.values()), 1024)
    assert len(lines) == 2 + 6 and "| MLA | 2 | 70,272 | 70,272 |" in lines[4]


def test_layouts_agree_with_the_planner_and_the_paper_at_every_degree():
    for v in VARIANTS:
        shape = v.shape
        for tp in shape.tp_degrees(8):
            ours = bytes_per_token_per_device(shape, tp)
            assert ours == shape.kv_bytes_per_device(tp), (v.name, tp)
            assert ours == paper_bytes_per_token_per_device(shape, tp), (v.name, tp)
            sent = transfer_bytes(shape, 1024, tp, tp)
            assert sent == shape.kv_transfer_bytes(1024, tp), (v.name, tp)
            assert sent == paper_transfer_bytes(shape, 1024, tp), (v.name, tp)


def test_transfer_does_not_depend_on_the_prefill_degree():
    gqa, mla = VARIANTS[1].shape, VARIANTS[2].shape
    # the head routes from 2 prefill ranks to 4 decode ranks carry each head once
    assert transfer_bytes(gqa, 1000, 2, 4) == transfer_bytes(gqa, 1000, 1, 1)
    assert transfer_bytes(gqa, 1000, 1, 1) == 63 * 16 * L * 2 * 8 * 128 * B  # whole blocks
    assert transfer_bytes(mla, 1024, 1, 4) == transfer_bytes(mla, 1024, 4, 4) == 1024 * L * 576 * B
    # MLA's replicated latent: once per decode instance, whatever its degree, as MHA's
    assert [table((t,))[2].transfer_vs_mha for t in (1, 8)] == [576 / 32768] * 2


@pytest.mark.timeout(120)
def test_decode_timing_runs_the_engine_path():
    ms, path = time_grouped(heads=4, kv_heads=2, head_dim=16, batch=2, context=40)
    assert ms > 0 and path in (
        "C kernel engine/attention/cpu_decode.c",
        "torch SDPA over gathered blocks",
    )
    # at TP 8 GQA-8's batch-1 1k cell holds 1 MiB; MHA's 16 MiB is skipped
    lines = report(VARIANTS, 8, max_cache_mib=2)
    assert "CPU: torch" in lines[0]
    gqa = next(line for line in lines if line.startswith("| GQA-8 | 8 | 1 | 1024 |"))
    assert "cpu_decode.c" in gqa or "SDPA" in gqa
    assert float(gqa.split("|")[6]) > 0
    # GLA-2's 2 latent heads shard over 2 ranks at most
    assert any(line.startswith("| GLA-2 | 2 | 1 | 1024 |") for line in lines)
    assert next(line for line in lines if line.startswith("| MHA | 8 | 1 | 1024 |")).endswith(
        "skipped (over 2 MiB) |"
    )
    gta = next(line for line in lines if line.startswith("| GTA-8 | 8 | 1 | 1024 |"))  # 0.75 MiB
    assert ("latent op not built" in gta) is not bool(latent_decode_ops())


@pytest.mark.timeout(120)
def test_measured_handoff_equals_the_layout():
    gqa, mla, gla2 = VARIANTS[1].shape, VARIANTS[2].shape, VARIANTS[4].shape
    # 40 tokens: 3 blocks, the last one partly filled, sent whole
    m = measure_handoff(gqa, 40, 2, 4, layers=1)
    one = replace(gqa, num_layers=1)
    assert m.sent == m.landed == transfer_bytes(one, 40, 2, 4) == 3 * 16 * 2 * 8 * 128 * B
    # MLA: its whole row once, to decode rank 0 of 2; GLA-2: each latent head once, 2 RoPE keys
    m = measure_handoff(mla, 40, 1, 2, layers=1)
    assert m.sent == m.landed == 3 * 16 * 576 * B
    m = measure_handoff(gla2, 40, 2, 2, layers=1)
    assert m.sent == m.landed == 3 * 16 * (2 * 256 + 2 * 64) * B
    lines = measured_lines(40, [(1, 2), (4, 4)], max_mib=0.5, variants=VARIANTS[1:5:3])
    # 196,608 B a layer: 2 layers fit half a MiB
    assert lines[3] == "| GQA-8 | 1 -> 2 | 2 | 393,216 | 393,216 | 393,216 | yes |"
    assert lines[6] == "| GLA-2 | 4 -> 4 | - | - | - | - | not sharded so |"
