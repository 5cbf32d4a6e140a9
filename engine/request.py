"""A request's state inside one engine: its tokens, progress and finish."""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field

from pdserve.engine.outputs import Logprobs
from pdserve.engine.reservation import Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative import Guesses
from pdserve.engine.structured import Matcher


class RequestStatus(enum.Enum):
    """WAITING -> RUNNING -> FINISHED; RUNNING -> WAITING when preempted (KV recomputed).
    A request whose KV arrives from elsewhere (engine/reservation.py) starts
    WAITING_FOR_KV -> RUNNING when it lands, or FINISHED when released first."""

    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """``delivered``: output tokens a client already received from an earlier attempt
    (a resumed request); they start the output, as if this engine had generated them.
    ``logprobs``: None unless the request asked (``params.logprobs``); then one entry per
    output token this engine sampled, in order (none for ``delivered``: their client
    already has them). ``prompt_logprobs``: None unless the request asked
    (``params.prompt_logprobs``) and has no delivered output; then one entry per prompt
    token computed so far (None for the first: nothing predicts it), until the request's
    first output takes them (``LLMEngine``), leaving None."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # prompt + generated tokens; the first num_computed_tokens have KV in the cache.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    # prompt tokens whose KV came from the prefix cache at the first admission (-1: not
    # admitted yet); the rest were computed for this request
    num_cached_tokens: int = -1
    logprobs: list[Logprobs] | None = field(init=False)
    prompt_logprobs: list[Logprobs | None] | None = field(init=False)
    # leaves the engine at its first token, its KV bound for another instance
    # (engine/prefilled.py)
    hand_off: bool = False
    started_s: float | None = None  # a hand-off's: wall clock of its first scheduled chunk
    # the blocks held for its KV arriving from elsewhere (set by ``admit_remote``)
    reservation: Reservation | None = None
    # where its output stands in its grammar (``params.guide``; engine/structured.py):
    # it has consumed every output token, delivered ones included
    matcher: Matcher | None = None
    # a choice forked from request ``parent_id`` once its prompt was computed
    # (engine/choices.py): choice ``index`` of it (0: the request itself)
    parent_id: str | None = None
    index: int = 0
    # the ids choices 1 .. n - 1 take when they fork, None where one was aborted before
    # (engine/choices.py); ``named_choices``: the caller named them, and each is a
    # request of its own once forked, else they are this request's ``choice_id``s
    choice_ids: list[str | None] = field(default_factory=list)
    named_choices: bool = False
    # this step's guessed next tokens, verified with its pending one, and how its guesses
    # fared so far (engine/speculative.py)
    draft: list[int] = field(default_factory=list)
    guesses: Guesses = field(default_factory=Guesses)
    delivered: InitVar[tuple[int, ...]] = ()

    def __post_init__(self, delivered: tuple[int, ...]):
        self.token_ids = [*self.prompt_token_ids, *delivered]
        self.logprobs = None if self.params.logprobs is None else []
        wanted = self.params.prompt_logprobs is not None and not delivered
        self.prompt_logprobs = [None] if wanted else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet in the cache."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def forks_now(self) -> bool:
        """Its next draw is its first and it asked for several choices: that draw forks
        them (engine/choices.py)."""
        return self.params.n > 1 and self.parent_id is None and self.num_output_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some prompt token's logprobs are still to be computed."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
