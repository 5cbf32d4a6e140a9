"""How the chaos tool names a stream that differs from the expected output."""

from __future__ import annotations

import pytest

from pdserve.loadgen.chaos_verdict import Verdict, verdict

EXPECTED = list(range(10, 20))  # 10 distinct tokens: 10, 11, ..., 19


@pytest.mark.parametrize(
    "got, want",
    [
        (EXPECTED, Verdict("ok")),
        # resumed one token too early: 13 again, then on; the last expected token never
        # comes because the stream still stops at max_tokens
        ([10, 11, 12, 13, 13, 14, 15, 16, 17, 18], Verdict("duplicate", 4, 1)),
        # a run of three re-emitted
        ([10, 11, 12, 13, 14, 12, 13, 14, 15, 16], Verdict("duplicate", 5, 3)),
        # a repeat at the very end, past the expected output
        ([*EXPECTED, 18, 19], Verdict("duplicate", 10, 2)),
        # resumed two tokens too late: 14 and 15 skipped, then two tokens beyond the
        # expected end (the offline run never made them)
        ([10, 11, 12, 13, 16, 17, 18, 19, 90, 91], Verdict("missing", 4, 2)),
        # the tail never came
        ([10, 11, 12], Verdict("missing", 3, 7)),
        ([], Verdict("missing", 0, 10)),
        # different tokens from position 6 on
        ([10, 11, 12, 13, 14, 15, 77, 78, 79, 80], Verdict("diverged", 6)),
        ([*EXPECTED, 55], Verdict("diverged", 10)),
    ],
)
def test_verdict_names_the_difference(got, want):
    assert verdict(EXPECTED, got) == want


def test_describe_names_kind_position_and_run():
    assert Verdict("duplicate", 4, 1).describe() == "duplicate: repeats 1 tokens at token 4"
    assert Verdict("missing", 3, 7).describe() == "missing: skips 7 tokens at token 3"
    assert Verdict("diverged", 6).describe() == "diverged at token 6"
