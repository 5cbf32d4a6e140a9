"""Incremental detokenization: text deltas as tokens arrive, and stop-string checks."""

from __future__ import annotations

from pdserve.engine.tokenizer import Tokenizer


class Detokenizer:
    """Decodes a growing list of output ids into text without re-decoding all of it.

    Byte-level BPE can split one character across tokens; text that ends in an
    incomplete character (U+FFFD) waits for the rest. Deltas hold back the last
    ``len(longest stop) - 1`` characters until the request finishes, so a stop
    string is never streamed in part.

    A resumed request starts from ``delivered`` (output ids a client already received)
    and ``delivered_chars`` (characters of text it received, counted as Python string
    characters, i.e. code points): the state is what an uninterrupted run had after those
    ids (each fed as it was generated, so an incomplete character or held-back stop
    prefix at their end is pending just as it was), with ``delivered_chars`` characters
    emitted. The next delta then starts exactly where the client's text ends.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        delivered: tuple[int, ...] = (),
        delivered_chars: int = 0,
    ):
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""
        self._settled = 0  # output ids before this index are decoded into self.text
        self._emitted = 0  # characters of self.text already returned by delta()
        self._hold = max((len(s) for s in stop), default=1) - 1
        for n in range(1, len(delivered) + 1):
            found = self.update(list(delivered[:n]))
            if found is not None:
                raise ValueError(
                    f"delivered: its first {n} tokens' text holds the stop string "
                    f"{found!r}; a request that stopped cannot be resumed"
                )
        if not 0 <= delivered_chars <= len(self.text):
            raise ValueError(
                f"delivered_chars={delivered_chars}: the {len(delivered)} delivered tokens "
                f"decode to {len(self.text)} settled characters; must be in "
                f"[0, {len(self.text)}]"
            )
        self._emitted = delivered_chars

    def update(self, ids: list[int]) -> str | None:
        """Feed all output ids so far; returns the stop string that ended the text, if any."""
        pending = self.tokenizer.decode(ids[self._settled :])
        if pending.endswith("\ufffd"):
            return None
        start = len(self.text)
        self.text += pending
        self._settled = len(ids)
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def delta(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
