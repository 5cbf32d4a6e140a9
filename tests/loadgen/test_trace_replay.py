"""Replays of the shipped production traces with the embedded SmolLM2 tokenizer: the
window, the time scale keeping the arrival shape, the token scale and the context,
prompts of real text per seed, Mooncake's shared prefixes as the engine's prefix cache
keys them, and the options' errors."""

from __future__ import annotations

import argparse

import pytest

from pdserve.engine.block_hash import block_hashes
from pdserve.loadgen.report import html_report, replay_line
from pdserve.loadgen.trace_replay import block_tokens, read_rows, trace_window
from pdserve.loadgen.workload_args import add_workload_arguments, parse_common
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info
from tests.loadgen.test_trace_formats import AZURE, MOONCAKE

LIMIT = 200  # ShareGPT conversations the prompts' text comes from
SCALE = 1 / 32  # Mooncake's 512-token blocks -> 16 tokens, the engine's block size


@pytest.fixture(scope="module")
def tok():
    return model_info("smollm2-135m")


def spec(name: str, **kw) -> WorkloadSpec:
    trace = str(AZURE if name == "azure" else MOONCAKE)
    return WorkloadSpec(name, trace=trace, dataset_limit=LIMIT, **kw)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name", ["azure", "mooncake"])
def test_window_and_time_scale_keep_the_arrival_shape(tok, name):
    tokenizer, max_len = tok
    s = spec(name, trace_start_s=1200, trace_duration_s=40, time_scale=2.5, token_scale=SCALE)
    reqs = make_workload(s, tokenizer, 0, 1.0, max_len)
    rows = [r for r in read_rows(name, s.trace) if 1200 <= r.arrival_s < 1240]
    assert len(reqs) == len(rows) == len(trace_window(s).rows) > 20
    # each arrival: its trace time after the window's start, times 2.5; so every gap is
    # the trace's gap times 2.5 (bursts and lulls kept, not re-drawn)
    assert [r.arrival_s for r in reqs] == pytest.approx([(r.arrival_s - 1200) * 2.5 for r in rows])
    trace_gaps = [b.arrival_s - a.arrival_s for a, b in zip(rows, rows[1:], strict=False)]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    assert max(trace_gaps) > 5 * min(trace_gaps)  # the window has a shape to keep
    assert all(g == pytest.approx(2.5 * t, abs=1e-6) for g, t in zip(gaps, trace_gaps, strict=True))
    window = trace_window(s)
    assert window.replay_s == 100 and window.offered_rate == pytest.approx(len(rows) / 100)
    summary = window.describe()
    assert "window 1200-1240 s" in summary and "time scale 2.5" in summary
    assert f"token scale {SCALE:g}" in summary and f"{len(rows)} requests over 100 s" in summary


def test_token_scale_lengths_and_the_context(tok):
    tokenizer, max_len = tok
    s = spec("azure", trace_start_s=1200, trace_duration_s=20, token_scale=0.1)
    rows = trace_window(s).rows
    reqs = make_workload(s, tokenizer, 0, 1.0, max_len)
    assert [len(r.prompt_token_ids) for r in reqs] == [
        max(1, round(r.prompt_len * 0.1)) for r in rows
    ]
    assert [r.output_len for r in reqs] == [max(1, round(r.output_len * 0.1)) for r in rows]
    assert max(len(r.prompt_token_ids) for r in reqs) > 100
    # a small context: the output kept, the prompt's tail cut; the head is the same text
    short = make_workload(s, tokenizer, 0, 1.0, max_model_len=96)
    for full, cut in zip(reqs, short, strict=True):
        assert (
            len(cut.prompt_token_ids) + cut.output_len <= 96 and cut.output_len == full.output_len
        )
        assert cut.prompt_token_ids == full.prompt_token_ids[: len(cut.prompt_token_ids)]
    capped = make_workload(
        spec("azure", trace_start_s=1200, trace_duration_s=20, token_scale=0.1,
             max_prompt_tokens=50, max_output_tokens=2),
        tokenizer, 0, 1.0, max_len,
    )  # fmt: skip
    assert max(len(r.prompt_token_ids) for r in capped) == 50
    assert max(r.output_len for r in capped) == 2


def test_prompts_are_real_text_and_the_seed_decides_them(tok):
    tokenizer, max_len = tok
    kw = dict(trace_start_s=300, trace_duration_s=10, token_scale=SCALE)
    a = make_workload(spec("mooncake", seed=1, **kw), tokenizer, 0, 1.0, max_len)
    b = make_workload(spec("mooncake", seed=1, **kw), tokenizer, 0, 1.0, max_len)
    c = make_workload(spec("mooncake", seed=2, **kw), tokenizer, 0, 1.0, max_len)
    assert a == b and [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in a] == [
        (r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in c
    ]
    text = tokenizer.decode(a[0].prompt_token_ids)
    assert sum(ch.isalpha() for ch in text) > len(text) / 2  # words, not token noise
    # the warm-up: the window's first requests at once, no block shared with the replay
    warm = make_workload(spec("mooncake", seed=1, **kw), tokenizer, 3, float("inf"), max_len)
    assert [r.arrival_s for r in warm] == [0.0] * 3
    assert [len(r.prompt_token_ids) for r in warm] == [len(r.prompt_token_ids) for r in a[:3]]
    replayed = {h for r in a for h in block_hashes(r.prompt_token_ids, 16)}
    assert not replayed & {h for r in warm for h in block_hashes(r.prompt_token_ids, 16)}


def longest_earlier_run(rows) -> list[tuple[int, int]]:
    """Per request: (the first earlier request sharing the longest leading run of
    hash ids with it, that run's length); (-1, 0) when none shares one."""
    first: dict[tuple[int, ...], int] = {}
    out = []
    for j, row in enumerate(rows):
        k = next((k for k in range(len(row.hash_ids), 0, -1) if row.hash_ids[:k] in first), 0)
        out.append((first[row.hash_ids[:k]] if k else -1, k))
        for k in range(1, len(row.hash_ids) + 1):
            first.setdefault(row.hash_ids[:k], j)
    return out


def test_mooncake_shared_hash_ids_share_exactly_those_blocks(tok):
    tokenizer, max_len = tok
    s = spec("mooncake", trace_start_s=900, trace_duration_s=120, token_scale=SCALE)
    rows = trace_window(s).rows
    reqs = make_workload(s, tokenizer, 0, 1.0, max_len)
    size = block_tokens(SCALE)
    assert size == 16
    runs = []
    for j, (i, run) in enumerate(longest_earlier_run(rows)):
        if i < 0 or run >= min(len(rows[i].hash_ids), len(rows[j].hash_ids)):
            continue  # both must hold the run's blocks whole and one more block each
        ids_i, ids_j = reqs[i].prompt_token_ids, reqs[j].prompt_token_ids
        assert common_prefix(ids_i, ids_j) >= run * size
        # the engine's prefix-cache keys (16-token blocks) match over exactly the run
        hi, hj = block_hashes(ids_i, 16), block_hashes(ids_j, 16)
        assert hi[:run] == hj[:run]
        if len(hi) > run and len(hj) > run:
            assert hi[run] != hj[run]
        runs.append(run)
    assert len(runs) > 100 and max(runs) >= 8  # the window reuses long prefixes
    # the window's prompts repeat blocks as its trace repeats runs of hash ids, and only
    # so (no two ids' blocks are equal text, though the text drawn goes round)
    keys = [h for r in reqs for h in block_hashes(r.prompt_token_ids, 16)]
    runs = [
        row.hash_ids[: k + 1]
        for row, r in zip(rows, reqs, strict=True)
        for k in range(len(r.prompt_token_ids) // 16)
    ]
    assert len(keys) == len(runs) and len(set(keys)) == len(set(runs)) < 0.95 * len(runs)


def test_cli_options(tok):
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    base = ["--workload", "mooncake", "--trace", str(MOONCAKE)]
    args = p.parse_args([*base, "--start", "600", "--duration", "30", "--time-scale", "4",
                         "--token-scale", "0.05"])  # fmt: skip
    rates, s, _ = parse_common(args, None)
    assert (s.trace_start_s, s.trace_duration_s, s.time_scale, s.token_scale) == (600, 30, 4, 0.05)
    assert rates == [trace_window(s).offered_rate]  # the replay's one pace
    for extra, match in [
        (["--rates", "1,2"], "--rates, --search: not with --workload mooncake"),
        (["--search"], "--rates, --search: not with --workload mooncake"),
        (["--time-scale", "0"], "time_scale 0.0: must be a finite number > 0"),
        (["--token-scale", "-1"], "token_scale -1.0: must be a finite number > 0"),
        (["--start", "-5"], "trace_start_s -5.0: must be >= 0"),
        (["--start", "4000"], "trace_start_s 4000: past the trace's last arrival; allowed 0 to"),
        (["--prompt-scale", "0.5"], "prompt_scale 0.5: workload mooncake keeps"),
        (["--burstiness", "0.5"], "burstiness 0.5: workload mooncake keeps"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_common(p.parse_args([*base, *extra]), None)
    with pytest.raises(ValueError, match="workload azure: give the trace file"):
        parse_common(p.parse_args(["--workload", "azure"]), None)
    with pytest.raises(ValueError, match="trace_start_s 10.0: only for workloads azure, mooncake"):
        parse_common(p.parse_args(["--start", "10"]), None)
    with pytest.raises(ValueError, match="trace window 100-100.5 s .*no request"):
        trace_window(spec("azure", trace_start_s=100, trace_duration_s=0.5))


def test_the_compare_report_states_the_window_and_scales():
    s = spec("azure", trace_start_s=600, trace_duration_s=30, time_scale=4, token_scale=0.1)
    contender = {"name": "a", "devices": 2, "runs": [], "goodput": {"goodput": 0, "met": False}}
    results = {
        "workload": {"name": "azure", "seed": 0},
        "duration_s": 30,
        "slo": {"ttft_ms": 1000, "tpot_ms": 150, "attainment": 0.9},
        "contenders": [contender],
        "devices": {"a": 2},
        "same_devices": True,
        "trace_replay": trace_window(s).to_dict(),
    }
    line = "azure trace azure-llm-2023-code.csv, window 600-630 s of 3436 s, time scale 4"
    assert f"<p>Replay of {line}" in html_report(results, {})
    assert replay_line(results).startswith(line) and "token scale 0.1: " in replay_line(results)
    assert replay_line({**results, "trace_replay": None}) is None
