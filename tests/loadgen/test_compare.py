"""``pdserve compare`` end to end: a co-located (1 device) and a disaggregated (2
devices) cluster of the tiny chat model on the same few requests, then the report's
files, and every figure in them recomputed from the per-request records."""

from __future__ import annotations

import base64
import json
import re

import yaml
from PIL import Image

from pdserve.cluster.cli import main
from pdserve.loadgen.compare import SLO_SCALES
from pdserve.loadgen.metrics import SLO, Record, attainment, goodput_from, summarize
from pdserve.loadgen.report import PLOTS, ROW_LABELS, fmt_goodput, rows_at, table, text_table
from tests.cluster.helpers import make_chat_model, small_cluster_config
from tests.cluster.test_disagg import disagg_config

PNG = b"\x89PNG\r\n\x1a\n"


def test_compare_colocated_and_disaggregated(chat_model, tmp_path, capsys):
    colocated = small_cluster_config(chat_model)
    colocated["colocated"]["instances"] = 1
    paths = []
    for name, config in [
        ("colocated", colocated),
        ("disagg", disagg_config(chat_model, "gloo", True, 1)),
    ]:
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(config))
    out = tmp_path / "report"
    argv = ["compare", *map(str, paths), "--workload", "humaneval", "--rates", "1,3"]
    argv += ["--duration", "1", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500", "--out", str(out)]
    argv += ["--max-prompt-tokens", "48", "--max-output-tokens", "6", "--warmup", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    results = json.loads((out / "results.json").read_text())
    slo = SLO(2000, 500, 0.9)
    contenders = results["contenders"]
    assert [c["name"] for c in contenders] == ["colocated", "disagg"]
    assert results["devices"] == {"colocated": 1, "disagg": 2} and not results["same_devices"]
    assert "different numbers of devices (colocated: 1, disagg: 2)" in printed

    for c in contenders:
        assert [run["rate"] for run in c["runs"]] == [1, 3]
        measured = {}
        for run in c["runs"]:
            records = [Record.from_dict(r) for r in run["records"]]
            assert run["summary"] == summarize(records, slo)
            assert run["summary"]["errors"] == 0
            measured[run["rate"]] = attainment(records, slo)
        expected = goodput_from(measured, slo.attainment)
        assert c["goodput"]["goodput"] == expected.goodput
        assert c["goodput"]["per_device"] == expected.goodput / c["devices"]
        assert c["goodput"]["attainment"] == [[r, a] for r, a in expected.attainment.items()]

    # the same requests, in the same order, at each rate
    for a, b in zip(contenders[0]["runs"], contenders[1]["runs"], strict=True):
        shape = [[(r["prompt_tokens"], r["output_len"]) for r in run["records"]] for run in (a, b)]
        assert shape[0] == shape[1] and len(shape[0]) == round(a["rate"])
    assert {r["instances"][0] for r in contenders[1]["runs"][0]["records"]} == {"prefill-0"}

    # the SLO-scale curve, recomputed
    curve = results["slo_scale"]
    assert curve["rate"] in (1, 3) and curve["scales"] == list(SLO_SCALES)
    for c in contenders:
        run = next(run for run in c["runs"] if run["rate"] == curve["rate"])
        records = [Record.from_dict(r) for r in run["records"]]
        assert curve["attainment"][c["name"]] == [
            attainment(records, slo.scaled(k)) for k in SLO_SCALES
        ]

    # the table: each cell from the recomputed figures
    header, rows = table(results)
    assert header == ["", "colocated", "disagg"]
    by_label = {row[0]: row[1:] for row in rows}
    assert by_label["devices"] == ["1", "2"]
    assert by_label["goodput (req/s)"] == [fmt_goodput(c["goodput"]) for c in contenders]
    for rate in (1, 3):
        for i, c in enumerate(contenders):
            run = next(run for run in c["runs"] if run["rate"] == rate)
            fresh = rows_at(summarize([Record.from_dict(r) for r in run["records"]], slo))
            assert [by_label[f"{label} @ {rate}/s"][i] for label in ROW_LABELS] == fresh
            kv = run["summary"]["mean_kv_bytes"]
            assert (kv > 0) == (c["name"] == "disagg") and 0 <= run["summary"]["hit_rate"] < 1
    assert text_table(header, rows) in printed

    # the plots are PNGs, and report.html embeds them and the table, nothing external
    page = (out / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and base64.b64encode(data).decode() in embedded
        with Image.open(out / name) as image:
            image.verify()
            assert image.size == (640, 420)
    assert len(embedded) == len(PLOTS) and "http" not in page.replace("http-equiv", "")
    for row in rows:
        assert all(f">{cell}</t" in page for cell in row if cell)


def test_cli_refuses_bad_arguments_before_launching(chat_model, tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(small_cluster_config(chat_model)))
    other = make_chat_model(tmp_path / "other-model")
    b.write_text(yaml.safe_dump(small_cluster_config(other)))
    assert main(["compare", str(a)]) == 2
    assert main(["compare", str(a), str(b)]) == 2
    assert main(["compare", str(a), str(a), "--slo-scales", "0,1"]) == 2
    assert main(["compare", str(a), str(a), "--rates", "1,2", "--scale-rate", "3"]) == 2
    assert main(["compare", "--endpoint", "http://127.0.0.1:1", "--endpoint", "x"]) == 2
    err = capsys.readouterr().err
    assert "at least two configs" in err and "serve different models" in err
    assert "--slo-scales: give positive" in err and "--scale-rate: must be one of" in err
    assert "with endpoints only, give --model" in err
