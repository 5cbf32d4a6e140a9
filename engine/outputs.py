"""What the engine reports per request after a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
