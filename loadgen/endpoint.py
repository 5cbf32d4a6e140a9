"""A client for an external OpenAI-compatible server (vLLM, SGLang, ...), so that
``pdserve bench --endpoint URL`` replays the same workload against it.

Each request is ``POST {URL}/v1/completions`` with the prompt as a list of token ids,
``max_tokens`` = the request's output length, temperature 0, ``stream: true`` and
``ignore_eos: true`` (vLLM's extra parameter: every request produces the tokens the
workload asks for). The times are measured here, from the server-sent events: TTFT
from sending to the first chunk with a choice, TPOT the mean gap after it over the
remaining tokens (``usage.completion_tokens`` when the server reports it, else the
number of chunks), e2e to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import time

from pdserve.loadgen.metrics import Record
from pdserve.loadgen.workloads import Request

DONE = object()  # the stream's last event, ``data: [DONE]``


def completion_body(req: Request, model: str | None) -> dict:
    body = {
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if model:
        body["model"] = model
    return body


def parse_event(line: str):
    """One line of a server-sent event stream: its JSON data, ``DONE``, or None for
    anything else (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return DONE
    return json.loads(data) if data else None


class EndpointClient:
    """``fill(record, request, timeout_s)`` sends one request and fills its record."""

    def __init__(self, url: str, model: str | None = None):
        self.url = url.rstrip("/")
        self.model = model if model is not None else self.served_model()
        self._client = None

    def served_model(self) -> str | None:
        """The first model ``GET /v1/models`` lists, or None when it lists none."""
        import httpx

        r = httpx.get(f"{self.url}/v1/models", timeout=10.0)
        r.raise_for_status()
        models = r.json().get("data") or []
        return models[0]["id"] if models else None

    def _http(self):
        import httpx

        if self._client is None:  # one per replay: each runs its own event loop
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=None, limits=limits)
        return self._client

    async def fill(self, rec: Record, req: Request, timeout_s: float | None) -> None:
        import httpx

        try:
            await asyncio.wait_for(self._stream(rec, req), timeout_s)
        except TimeoutError:
            rec.error = f"DEADLINE_EXCEEDED: no end after {timeout_s:g} s"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            rec.error = f"{type(e).__name__}: {e}"

    async def _stream(self, rec: Record, req: Request) -> None:
        url, body = f"{self.url}/v1/completions", completion_body(req, self.model)
        sent = time.monotonic()
        first = last = None
        chunks, usage = 0, None
        async with self._http().stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {r.status_code}: {text}"
                return
            async for line in r.aiter_lines():
                event = parse_event(line)
                if event is DONE:
                    break
                if event is None:
                    continue
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
        end = time.monotonic()
        if first is None:
            rec.error = "the stream ended without a token"
            return
        rec.completion_tokens = (usage or {}).get("completion_tokens") or chunks
        rec.ttft_ms = (first - sent) * 1e3
        n = rec.completion_tokens
        rec.tpot_ms = (last - first) * 1e3 / (n - 1) if n > 1 else 0.0
        rec.e2e_ms = (end - sent) * 1e3

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def close(self) -> None:
        pass  # nothing outlives a replay
