"""``pdserve bench --endpoint``: the OpenAI-compatible client's request bodies and its
reading of a server-sent event stream, over real HTTP to a minimal server started
here that streams canned chunks (a transport test: no model behind it)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.cluster.cli import main
from pdserve.loadgen.endpoint import DONE, parse_event
from pdserve.loadgen.workloads import WorkloadSpec, make_workload, model_info

FIRST_S, GAP_S = 0.08, 0.02  # the canned server's delay to the first chunk, then between


def refused(prompt: list[int]) -> bool:
    return sum(prompt) % 3 == 0  # some requests, to see an HTTP error recorded


class CannedServer(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "served-name", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if self.path != "/v1/completions" or refused(body["prompt"]):
            return self._json(500, {"error": "no"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            threading.Event().wait(FIRST_S if i == 0 else GAP_S)
            choice = {
                "index": 0,
                "text": f"t{i}",
                "finish_reason": "length" if i == n - 1 else None,
            }
            self._event({"id": "c", "choices": [choice]})
        self._event({"id": "c", "choices": [], "usage": {"completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), CannedServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    CannedServer.bodies = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_parse_event():
    assert parse_event('data: {"a": 1}') == {"a": 1}
    assert parse_event("data: [DONE]") is DONE
    assert parse_event("") is None and parse_event(": keep-alive") is None


def test_bench_against_an_endpoint(chat_model, server, tmp_path):
    out = tmp_path / "results.json"
    argv = ["bench", "--endpoint", server, "--model", chat_model, "--workload", "humaneval"]
    argv += ["--rates", "4", "--duration", "2", "--max-prompt-tokens", "40"]
    argv += ["--max-output-tokens", "6", "--warmup", "0", "--devices", "2", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert results["endpoint"] == server and results["devices"] == 2 and results["cluster"] is None

    tokenizer, max_len = model_info(chat_model)
    spec = WorkloadSpec("humaneval", max_prompt_tokens=40, max_output_tokens=6)
    requests = make_workload(spec, tokenizer, 8, 4.0, max_len)
    expected = [
        {
            "model": "served-name",
            "prompt": req.prompt_token_ids,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        for req in requests
    ]
    assert sorted(CannedServer.bodies, key=json.dumps) == sorted(expected, key=json.dumps)
    assert 0 < sum(refused(r.prompt_token_ids) for r in requests) < len(requests)
    records = results["runs"][0]["records"]
    for r, req in zip(records, requests, strict=True):
        assert r["prompt_tokens"] == len(req.prompt_token_ids)
        if refused(req.prompt_token_ids):
            assert r["error"].startswith("HTTP 500") and r["ttft_ms"] is None
            continue
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["completion_tokens"] == req.output_len
        # a generous bound on the event: a loaded host's client read it 1.5 s late once
        assert FIRST_S * 1e3 <= r["ttft_ms"] < FIRST_S * 1e3 + 3000
        # the server sleeps GAP_S between chunks; the client reads them a little late or
        # early (a late first chunk shortens the mean gap), so the band is generous
        if req.output_len > 1:
            assert GAP_S * 1e3 / 2 <= r["tpot_ms"] < GAP_S * 1e3 + 30
        assert r["e2e_ms"] >= (FIRST_S + (req.output_len - 1) * GAP_S) * 1e3
