"""``pdserve chaos`` end to end on the tiny model: a run that SIGKILLs an instance and
the supervisor passes its gate with every signalled role recovered and every stream
complete and as expected; a run in which no fault fires (``--kill-every`` past the run)
fails the gate though every stream is fine; and a run that SIGKILLs the router, whose
streams resume on its next incarnation."""

from __future__ import annotations

import json

import pytest
import yaml

from pdserve.cluster.cli import main
from pdserve.loadgen.chaos_report import JSON_NAME, PLOT_NAME
from tests.cluster.helpers import small_cluster_config

SUPERVISOR = {"heartbeat_s": 0.5, "unresponsive_s": 3.0}


def chaos(chat_model, tmp_path, *flags: str) -> tuple[int, dict]:
    """``pdserve chaos`` on two co-located tiny instances: its exit status and figures."""
    config = tmp_path / "tiny.yaml"
    tiny = {**small_cluster_config(chat_model), "supervisor": SUPERVISOR}
    config.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "chaos"
    code = main(["chaos", str(config), "--arrivals", "constant", "--max-prompt-tokens", "24",
                 "--out", str(out), *flags])  # fmt: skip
    assert (out / PLOT_NAME).read_bytes().startswith(b"\x89PNG")
    return code, json.loads((out / JSON_NAME).read_text())


def assert_every_stream_as_expected(results: dict, requests: int, max_tokens: int) -> None:
    s = results["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (requests, requests, 0), s
    assert (s["mismatched"], s["leaked_blocks"], s["unchecked_instances"]) == (0, 0, []), s
    assert all(len(r["token_ids"]) == max_tokens and r["verdict"]["kind"] == "ok"
               for r in results["requests"])  # fmt: skip
    assert set(results["integrity"]) == {"colocated-0", "colocated-1"}
    assert all(i["leaked"] == 0 for i in results["integrity"].values())


@pytest.mark.timeout(420)
def test_chaos_kills_an_instance_and_the_supervisor_and_every_one_recovers(
    chat_model, tmp_path, capsys
):
    # 40 requests over 13 s, a SIGKILL each 5 s: the first round of two signals hits
    # both roles (in a seeded order) while streams are in flight
    code, results = chaos(chat_model, tmp_path, "--requests", "40", "--rate", "3",
                          "--max-tokens", "16", "--kill-every", "5",
                          "--role", "colocated,supervisor", "--signal", "KILL",
                          "--settle-s", "90", "--recover-s", "60")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    s = results["summary"]
    assert s["passed"] and s["reasons"] == [] and results["settled"], s
    assert_every_stream_as_expected(results, 40, 16)
    roles = s["roles"]
    assert set(roles) == {"colocated", "supervisor"}, roles
    assert all(r["kills"] >= 1 and r["recovered"] == r["kills"] for r in roles.values()), roles
    signalled = [k for k in results["kills"] if k["skipped"] is None]
    assert len(signalled) == s["kills"] == s["recovered"] >= 2
    supervisor = [k for k in signalled if k["role"] == "supervisor"]
    assert all(k["target"] == "supervisor" and k["signal"] == "KILL" for k in supervisor)
    # recovered: a new supervisor process answered (control_recovery), within the bound
    assert all(0 < k["recovery"]["seconds"] <= 60 for k in signalled), signalled
    samples = results["timeline"]
    for k in supervisor:
        after = [t["pids"]["supervisor"] for t in samples if t["t"] > k["t"]]
        assert any(p not in (None, k["pid"]) for p in after), (k, after)
    assert "per role:" in printed and "chaos: passed" in printed


@pytest.mark.timeout(300)
def test_chaos_gate_fails_when_no_fault_fires(chat_model, tmp_path, capsys):
    # every stream completes as expected, and still the gate fails: nothing was signalled
    code, results = chaos(chat_model, tmp_path, "--requests", "8", "--rate", "16",
                          "--max-tokens", "8", "--kill-every", "1000",
                          "--settle-s", "10")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 1, printed
    s = results["summary"]
    assert_every_stream_as_expected(results, 8, 8)
    assert s["kills"] == 0 and results["kills"] == [] and s["roles"] == {}, s
    assert not s["passed"] and len(s["reasons"]) == 1, s
    assert s["reasons"][0].startswith("no fault fired: 0 signals sent"), s
    samples = [t for t in results["timeline"] if not t["error"]]
    assert samples and all(t["live"] == 2 for t in samples)
    assert all(t["pids"]["supervisor"] and t["pids"]["router"] for t in samples)
    assert "the gate failed:" in printed and "chaos: FAILED" in printed


@pytest.mark.timeout(420)
def test_chaos_kills_the_router_and_it_serves_again(chat_model, tmp_path, capsys):
    code, results = chaos(chat_model, tmp_path, "--requests", "40", "--rate", "3",
                          "--max-tokens", "16", "--kill-every", "10", "--role", "router",
                          "--signal", "KILL", "--settle-s", "90")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    s = results["summary"]
    assert s["passed"] and s["roles"]["router"]["kills"] >= 1, s
    assert s["roles"]["router"]["recovered"] == s["roles"]["router"]["kills"], s
    assert_every_stream_as_expected(results, 40, 16)
