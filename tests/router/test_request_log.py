"""router/request_log.py without a cluster: the request line as text and as JSON, and
the ``logging`` values it refuses (a real cluster's JSON line:
tests/cluster/test_router_metrics.py)."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.request_log import JsonFormatter, configure, log_request
from pdserve.router.stream import Delta, RequestStream


def finished_stream() -> RequestStream:
    stream = RequestStream("req-7", [1, 2, 3], SamplingParams(max_tokens=2))
    stream.sent_to("prefill-1")
    stream.sent_to("decode-0")
    stream.attempt.report({"kv_bytes": 4096, "transfer_s": 0.002, "cached_tokens": 2})
    stream.deliver(Delta([5], "a"))
    stream.deliver(Delta([6], "b", "length"))
    return stream


def test_the_request_line_as_text_and_as_json(caplog):
    with caplog.at_level(logging.INFO, logger="router.requests"):
        log_request(finished_stream(), "length")
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("request req-7 length instances=prefill-1,decode-0 prompt_tokens=3 ")
    assert "output_tokens=2" in text and "kv_bytes=4096" in text and "attempts=1" in text
    assert "prompt_tokens=3 cached_tokens=2 " in text
    line = json.loads(JsonFormatter().format(record))
    assert line["logger"] == "router.requests" and line["level"] == "INFO"
    assert line["request_id"] == "req-7" and line["outcome"] == "length"
    assert line["instances"] == ["prefill-1", "decode-0"] and line["output_tokens"] == 2
    assert line["kv_bytes"] == 4096 and line["transfer_ms"] == 2.0 and line["cached_tokens"] == 2
    assert 0 < line["ttft_ms"] <= line["e2e_ms"] and line["message"] == text


def test_a_format_or_level_not_allowed_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="logging.format='xml': allowed values are text, json"):
        configure("xml", "INFO")
    with pytest.raises(ValueError, match="logging.level='LOUD'"):
        configure("text", "LOUD")
