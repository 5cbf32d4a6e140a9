"""The readers of the Azure 2023 CSV and Mooncake JSONL traces: the shipped files read
whole with the figures their README states, and every kind of bad row named by line
and field."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pdserve.loadgen.trace_formats import TraceFormatError, read_azure, read_mooncake

TRACES = Path(__file__).resolve().parents[2] / "loadgen" / "traces"
AZURE = TRACES / "azure-llm-2023-code.csv"
MOONCAKE = TRACES / "mooncake-fast25-conversation.jsonl"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_the_shipped_copies_keep_their_licenses_and_attribution():
    names = {p.name for p in TRACES.iterdir()}
    assert {"LICENSE-azure-CC-BY-4.0.txt", "LICENSE-mooncake-Apache-2.0.txt"} <= names
    readme = (TRACES / "README.md").read_text()
    assert "Splitwise" in readme and "Mooncake: Trading More Storage" in readme


def test_azure_code_trace():
    rows = read_azure(AZURE)
    assert len(rows) == 8819
    # 2023-11-16 18:17:03.9799600, 4808 prompt tokens, 10 generated: the first line
    assert (rows[0].arrival_s, rows[0].prompt_len, rows[0].output_len) == (0.0, 4808, 10)
    assert rows[1].arrival_s == pytest.approx(0.052, abs=1e-6)  # .0319600 - .9799600 + 1
    assert 56 * 60 < rows[-1].arrival_s < 58 * 60  # "57 min"
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:], strict=False))
    assert round(statistics.mean(r.prompt_len for r in rows)) == 2048
    assert round(statistics.mean(r.output_len for r in rows)) == 28
    assert all(r.hash_ids == () for r in rows)


def test_mooncake_conversation_trace():
    rows = read_mooncake(MOONCAKE)
    assert len(rows) == 12031
    assert rows[0].prompt_len == 6758 and rows[0].output_len == 500
    assert rows[0].hash_ids == tuple(range(14)) and rows[1].hash_ids[:2] == (0, 14)
    assert rows[-1].arrival_s == pytest.approx(3536.999)  # milliseconds -> seconds
    assert round(statistics.mean(r.prompt_len for r in rows)) == 12035
    ids = [h for r in rows for h in r.hash_ids]
    assert 1 - len(set(ids)) / len(ids) == pytest.approx(0.37, abs=0.01)  # blocks repeated


def test_rows_are_sorted_by_arrival_from_the_first(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(HEADER + "2023-11-16 18:17:05,10,2\n2023-11-16 18:17:03.5,20,3\n\n")
    assert [(r.arrival_s, r.prompt_len) for r in read_azure(path)] == [(0.0, 20), (1.5, 10)]
    path = tmp_path / "m.jsonl"
    row = {"timestamp": 900, "input_length": 600, "output_length": 1, "hash_ids": [4, 5]}
    path.write_text(json.dumps(row) + "\n\n" + json.dumps({**row, "timestamp": 400}) + "\n")
    assert [r.arrival_s for r in read_mooncake(path)] == pytest.approx([0.0, 0.5])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"a\.csv:1: header None: expected TIMESTAMP,ContextTokens,GeneratedTokens"),
        ("time,in,out\n", r"a\.csv:1: header \['time', 'in', 'out'\]"),
        (HEADER, r"a\.csv: no requests"),
        (HEADER + "2023-11-16 18:17:03,5\n", r"a\.csv:2: 2 fields .*: expected 3"),
        (HEADER + "16/11/2023 18:17,5,1\n", r"a\.csv:2: field TIMESTAMP '16/11/2023 18:17'"),
        (HEADER + "2023-11-16 18:17:03.x1,5,1\n", r"a\.csv:2: field TIMESTAMP"),
        (
            HEADER + "2023-11-16 18:17:03,5,1\n2023-11-16 18:17:04,five,1\n",
            r"a\.csv:3: field ContextTokens 'five': expected an integer >= 1",
        ),
        (HEADER + "2023-11-16 18:17:03,5,0\n", r"a\.csv:2: field GeneratedTokens '0'"),
    ],
)
def test_azure_bad_rows(tmp_path, text, match):
    path = tmp_path / "a.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=match):
        read_azure(path)


GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"m\.jsonl:2: not a JSON object"),
        ("[1, 2]", r"m\.jsonl:2: \[1, 2\]: expected a JSON object"),
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
            r"m\.jsonl:2: field hash_ids missing",
        ),
        (json.dumps({**GOOD, "timestamp": -1}), r"m\.jsonl:2: field timestamp -1: expected"),
        (json.dumps({**GOOD, "timestamp": "0"}), r"field timestamp '0'"),
        (json.dumps({**GOOD, "input_length": 0}), r"m\.jsonl:2: field input_length 0"),
        (json.dumps({**GOOD, "output_length": 2.5}), r"field output_length 2\.5"),
        (json.dumps({**GOOD, "hash_ids": [1, "2"]}), r"field hash_ids \[1, '2'\]"),
        (
            json.dumps({**GOOD, "hash_ids": [1, 2, 3]}),
            r"m\.jsonl:2: field hash_ids has 3 ids: input_length 1000 needs 2 "
            r"\(one per 512-token block\)",
        ),
    ],
)
def test_mooncake_bad_rows(tmp_path, line, match):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=match):
        read_mooncake(path)
