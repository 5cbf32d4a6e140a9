"""OpenAI's logprobs objects for the HTTP front end: a request's tokens' ``Logprobs``
(engine/outputs.py) in the shape each API returns (docs/serving.md, "Log-probabilities
and penalties").

Completions (body ``logprobs: N``), OpenAI's legacy shape, per choice or chunk::

    {"tokens": ["Hel", "lo"], "token_logprobs": [-0.3, -1.2],
     "top_logprobs": [{"Hel": -0.3, "He": -1.9}, ...], "text_offset": [0, 3]}

``top_logprobs[i]`` maps the N most likely tokens' text to their logprob, most likely
first, plus the sampled token when it is not among them (OpenAI: up to N + 1 entries;
two tokens with the same text keep the first, more likely one). ``text_offset[i]`` is
where token i's text starts in the completion, counted as the characters of the tokens
before it: the offsets run on across a stream's chunks.

Chat (``logprobs: true``, ``top_logprobs: N``)::

    {"content": [{"token": "Hel", "logprob": -0.3, "bytes": [72, 101, 108],
                  "top_logprobs": [{"token": "Hel", "logprob": -0.3, "bytes": [...]}, ...]}]}

with exactly the N most likely tokens in ``top_logprobs``. A token's text is its bytes
(``Tokenizer.token_bytes``) decoded as UTF-8, a byte-level token holding part of a
character showing U+FFFD there (``bytes`` is exact); a model without a tokenizer names
tokens ``token_id:<id>`` (vLLM's form).

A prompt's logprobs (``PromptReply``) are OpenAI's echo form or vLLM's
``prompt_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.outputs import Logprobs
from pdserve.engine.tokenizer import Tokenizer


class LogprobsShape:
    """One request's logprobs objects, chunk after chunk (it keeps the text offset)."""

    def __init__(self, chat: bool, tokenizer: Tokenizer | None):
        self.chat, self.tokenizer = chat, tokenizer
        self.offset = 0  # completions: characters of token text before the next token
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes, for this request

    def render(self, logprobs: list[Logprobs]) -> dict:
        """The object for these tokens (the next ones of the request, in order)."""
        return self._chat(logprobs) if self.chat else self._completions(logprobs)

    def _completions(self, logprobs: list[Logprobs]) -> dict:
        tokens, offsets, tops = [], [], []
        for lp in logprobs:
            text = self._text(lp.token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            top: dict[str, float] = {}
            for token_id, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(self._text(token_id), value)
            top.setdefault(text, lp.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat(self, logprobs: list[Logprobs]) -> dict:
        content = []
        for lp in logprobs:
            entry = self._entry(lp.token_id, lp.logprob)
            entry["top_logprobs"] = [
                self._entry(token_id, value)
                for token_id, value in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            content.append(entry)
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self._token_bytes(token_id)
        return {"token": self._text(token_id), "logprob": logprob, "bytes": list(raw)}

    def _text(self, token_id: int) -> str:
        return self._token_bytes(token_id).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            if self.tokenizer is None:
                raw = f"token_id:{token_id}".encode()
            else:
                raw = self.tokenizer.token_bytes(token_id)
            self._bytes[token_id] = raw
        return raw


@dataclass
class PromptReply:
    """How one reply shows its prompt's logprobs (``SamplingParams.prompt_logprobs``),
    which come with its first tokens (``Delta.prompt_logprobs``, ``pending`` until an
    object shows them):

    - ``echo`` N (completions' ``echo`` with ``logprobs: N``, OpenAI's legacy form): the
      choice's logprobs object starts with the prompt's tokens, the first with a null
      logprob and null alternatives, as OpenAI's;
    - ``vllm`` N (vLLM's ``prompt_logprobs: N``): a ``prompt_logprobs`` list, the
      choice's for completions and the response's for chat, as vLLM's: null for the
      first token, then per token ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for
      the prompt's token and its N most likely alternatives, the prompt's token first.
    """

    shape: LogprobsShape  # the reply's (echo: its text offsets run on into the completion)
    prompt_ids: list[int]
    echo: int | None = None
    vllm: int | None = None
    pending: list[Logprobs | None] | None = None

    def take_echo(self) -> dict | None:
        """The echoed prompt's logprobs object, once (None: not asked, or not yet here)."""
        if self.echo is None or self.pending is None:
            return None
        n, shape = self.echo, self.shape
        start = shape.offset
        first = shape._text(self.prompt_ids[0])
        shape.offset += len(first)
        scored = [lp for lp in self.pending if lp is not None]  # the first token has none
        rest = shape._completions(
            [replace(lp, top_ids=lp.top_ids[:n], top_logprobs=lp.top_logprobs[:n]) for lp in scored]
        )
        return {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [start, *rest["text_offset"]],
        }

    def vllm_list(self) -> list | None:
        """vLLM's ``prompt_logprobs`` (None: not asked, or not yet here)."""
        if self.vllm is None or self.pending is None:
            return None
        out: list[dict | None] = [None]
        for lp in self.pending:
            if lp is None:  # the first prompt token's: listed as null
                continue
            entry = {str(lp.token_id): self._entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
                if rank <= self.vllm:
                    entry.setdefault(str(i), self._entry(i, v, rank))
            out.append(entry)
        return out

    def _entry(self, token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.shape._text(token_id)}
