"""What a client of a resumed request sees, and where to cut a stream to resume it.

A *stream* is what a client receives: the token ids and one text delta per output (each
step gives a request at most one token), and the finish reason. Resuming from the
first ``k`` tokens of an uninterrupted stream must give exactly the rest of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine import SamplingParams

PROMPTS = {
    "en": "The capital of France is",
    # SmolLM2 answers in kana and kanji: tokens that end inside a UTF-8 character
    "ja": "Translate to Japanese: I like green tea. 日本語:",
}
MAX_TOKENS = 40


def sampling(mode: str, stop: list[str] | None = None) -> SamplingParams:
    """``greedy``, or ``seeded`` temperature sampling with a top-p cut."""
    stop = stop or []
    if mode == "greedy":
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=stop)
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True, stop=stop
    )


@dataclass
class Stream:
    token_ids: list[int]
    deltas: list[str]  # the text delta that came with each token
    finish_reason: str | None
    preemptions: int = 0

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def client_text(self, k: int) -> str:
        """The text a client held once it had received the first ``k`` tokens."""
        return "".join(self.deltas[:k])


def stream_of(engine, request_id: str, prompt, params, delivered=(), chars=0) -> Stream:
    """Run ``engine`` until request ``request_id`` (added here; delivered/chars: a
    resume) ends; its stream. Other requests on the engine run along."""
    request = engine.add_request(request_id, prompt, params, tuple(delivered), chars)
    s = Stream([], [], None)
    while s.finish_reason is None:
        for out in engine.step():
            if out.request_id == request_id:
                assert len(out.new_token_ids) == 1
                s.token_ids += out.new_token_ids
                s.deltas.append(out.new_text)
                s.finish_reason = out.finish_reason
    s.preemptions = request.num_preemptions
    return s


def mid_char_cuts(tokenizer, ids: list[int]) -> list[int]:
    """Cuts k whose first k tokens end inside a UTF-8 character."""
    return [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]


def cut_points(s: Stream, prompt_len: int, block_size: int, tokenizer) -> list[int]:
    """1, the cut where prompt + delivered fill whole KV blocks, mid-stream, the last
    token only left, and the first two cuts inside a multi-byte character."""
    n = len(s.token_ids)
    ks = {1, n // 2, n - 1, block_size - prompt_len % block_size}
    ks.update(mid_char_cuts(tokenizer, s.token_ids)[:2])
    return sorted(k for k in ks if 1 <= k < n)


def stop_string_of(s: Stream) -> str:
    """A stop string that occurs in ``s``'s text two thirds of the way in."""
    at = 2 * len(s.text) // 3
    return s.text[at : at + 3]


def streams_of(engine, requests: list[tuple]) -> list[Stream]:
    """Run ``engine`` until every one of ``requests`` (``(request_id, prompt, params,
    delivered, chars)``, added here together: one batch) ends; their streams, in order.
    An output does not depend on what else is in its batch (docs/architecture.md)."""
    added = [engine.add_request(rid, p, params, tuple(d), c) for rid, p, params, d, c in requests]
    streams = {rid: Stream([], [], None) for rid, *_ in requests}
    while any(s.finish_reason is None for s in streams.values()):
        for out in engine.step():
            s = streams.get(out.request_id)
            if s is not None:
                assert len(out.new_token_ids) == 1
                s.token_ids += out.new_token_ids
                s.deltas.append(out.new_text)
                s.finish_reason = out.finish_reason
    for request, s in zip(added, streams.values(), strict=True):
        s.preemptions = request.num_preemptions
    return list(streams.values())


def assert_resumes(full: Stream, k: int, resumed: Stream) -> None:
    """``resumed`` (from ``full``'s first ``k`` tokens) is exactly the rest of ``full``."""
    where = f"resumed after {k} of {len(full.token_ids)} tokens"
    assert full.token_ids[:k] + resumed.token_ids == full.token_ids, where
    assert full.client_text(k) + resumed.text == full.text, where
    assert resumed.finish_reason == full.finish_reason, where
