"""Step scheduler: chunked prefill piggybacked on continuous decode batching.

Each step spends a token budget (``max_batch_tokens``):
  1. running requests that decode (one pending token each), oldest first;
  2. running requests part-way through their prompt, a chunk each;
  3. waiting requests, FCFS, while the batch has room (``max_batch_size``); one with
     no KV yet starts from its longest cached prefix when prefix caching is on
     (engine/block_manager.py), and only the rest of its prompt is computed.
Prompt tokens (2 and 3) of a step that decodes are at most ``mixed_prefill_tokens``
when it is set (Sarathi-Serve's stall-free budget: a prompt spreads over several steps,
each as short as the decodes' TPOT allows); a step without decodes spends it all.
When a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed and it goes back to
the front of the queue to be recomputed (its generated tokens are kept; the full blocks
it had computed stay cached, so with prefix caching on the recomputation starts from
them unless they were evicted meanwhile). After each step, ``commit`` registers the
blocks that step filled and, with a sliding-window block manager, releases each
request's blocks that fell out of the window of its next token.

A request whose KV arrives from elsewhere (engine/reservation.py) is admitted by
``admit_remote`` as WAITING_FOR_KV when the running, waiting and remote requests leave
the batch room and the free blocks hold its tokens: its blocks are held from then on
(they count against every later admission, and a lone running request that cannot grow
waits for them to come back instead of ending); no step computes it until ``land``
moves it to the running batch, its KV in those blocks. ``remove`` frees it in either
state. (Admitting a waiting request counts the running ones only: a reservation that
waits for a prompt queued here, a peer's in hybrid mode, must not block that prompt.)

A step that failed (``isolate``): each of its requests is recomputed the same way,
but alone: while suspects remain, a step holds one suspect and nothing else, and a
suspect is cleared once a step of its own samples its next token (``cleared``). So
a request that makes every step fail fails alone (the engine raises ``StepFailed``
for a failed step of one request), and the others carry on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.reservation import NoRoom, Reservation, layer_skip


@dataclass
class ScheduledBatch:
    """What one forward pass computes: ``(request, number of new tokens)`` pairs."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that cannot grow even alone in the cache; the engine finishes them.
    out_of_cache: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def prompt_tokens(self) -> int:
        """The prompt positions it computes, read before the step runs (a speculative
        step rolls a decode's computed tokens back after it: its rows are past the
        prompt either way)."""
        return sum(
            max(0, min(r.num_prompt_tokens, r.num_computed_tokens + n) - r.num_computed_tokens)
            for r, n in self.items
        )

    def __bool__(self) -> bool:
        return bool(self.items)

    def shape(self) -> StepShape:
        """What the step costs depend on (the planner's cost models fit step times to it).
        A decode is one new token of a request past its prompt (a speculative step's
        verified rows are one each); the rest are prompt chunks (a recomputation after
        preemption counts as prompt)."""
        tokens = sum_sq = decodes = context = 0
        for r, n in self.items:
            done = r.num_computed_tokens
            if n == 1 + len(r.draft) and done >= r.num_prompt_tokens:
                decodes += n
                context += n * (done + 1) + n * (n - 1) // 2
            else:
                tokens += n
                sum_sq += (done + n) ** 2 - done**2
        return StepShape(tokens, sum_sq, decodes, context)


def prompt_budget(max_batch_tokens: int, decodes: int, mixed_prefill_tokens: int | None) -> int:
    """Prompt tokens a step that decodes ``decodes`` requests has room for: what they
    leave of ``max_batch_tokens``, at most ``mixed_prefill_tokens`` (when set) if the
    step decodes. The router's prefill choice and the planner's simulator size chunks by
    this same rule."""
    budget = max(0, max_batch_tokens - decodes)
    if decodes and mixed_prefill_tokens is not None:
        budget = min(budget, mixed_prefill_tokens)
    return budget


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int
    sum_sq: int  # of the prompt chunks: (offset + n)^2 - offset^2 each (attention pairs x 2)
    decodes: int
    context: int  # KV tokens the decodes attend to, summed


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_tokens: int,
        max_batch_size: int,
        mixed_prefill_tokens: int | None = None,
        layer_windows: tuple[int | None, ...] = (),
    ):
        """``layer_windows``: each layer's sliding window (None: global), for the layer
        skips of remote KV (``Reservation.layer_skip``; empty: no layer skips)."""
        self.blocks = blocks
        self.layer_windows = layer_windows
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_KV, by id: blocks held, no step
        self.suspects: set[str] = set()  # ids of a failed step's requests, run alone
        self.num_preemptions = 0  # running requests preempted so far
        # prompt tokens of first admissions, and those of them the prefix cache held
        self.num_queried_tokens = self.num_hit_tokens = 0
        self.num_prompt_tokens_computed = 0  # EngineStats.computed_prompt_tokens

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit_remote(self, request: Request) -> Reservation | NoRoom:
        """Hold blocks for ``request``'s tokens (prompt + delivered), whose KV another
        instance computes and sends here, and take it as WAITING_FOR_KV; ``NoRoom``
        (nothing held) when the running, waiting and remote requests fill the batch
        (``max_batch_size``) or the free blocks cannot hold its tokens and one more.
        A model whose every layer slides starts its table with placeholders for the
        blocks before the window of its next token (at least one block is sent); of
        the rest, the leading blocks the prefix cache holds are shared (capped below the
        last token: at least one block is sent); the new ones are the reservation's
        ``block_ids``. Raises ValueError when its id already holds blocks here."""
        rid, tokens = request.request_id, request.token_ids
        if rid in self.remote or self.blocks.block_table(rid):
            raise ValueError(f"request_id={rid!r}: already in use")
        # a request of n choices counts n: they fork when it lands (engine/choices.py)
        remote = sum(r.params.n for r in self.remote.values())
        busy = len(self.running) + len(self.waiting) + remote
        if busy + request.params.n > self.max_batch_size:
            why = f"{busy} requests running, waiting or waiting for KV"
            return NoRoom(rid, f"{why}; max_batch_size={self.max_batch_size}")
        n, blocks = len(tokens), self.blocks
        outside = min(blocks.window_start(n), blocks.blocks_for(n) - 1)
        prefix = blocks.match(tokens)
        if not blocks.can_allocate(rid, n + 1, prefix, outside):  # and the first decode's
            need = blocks.num_new_blocks(rid, n + 1, prefix, outside)
            why = f"{n} tokens and one more need {need} free blocks"
            return NoRoom(rid, f"{why}, {blocks.num_free_blocks} are free")
        new = blocks.allocate(rid, n, prefix, outside)
        cached = max(0, len(prefix) - outside)
        skip = layer_skip(self.layer_windows, n, blocks.block_size, outside + cached)
        request.reservation = Reservation(rid, tuple(new), cached, outside, skip)
        request.status = RequestStatus.WAITING_FOR_KV
        self.remote[rid] = request
        return request.reservation

    def land(self, request: Request) -> None:
        """The KV of a WAITING_FOR_KV ``request``'s tokens is in its blocks: it joins the
        running batch (the caller appends its first token, sampled where the KV was
        computed, so it decodes from the next step). Its full blocks are registered in
        the prefix cache, but for the reservation's ``partial_blocks``."""
        reservation = request.reservation
        if self.remote.pop(request.request_id, None) is None or reservation is None:
            raise ValueError(f"request_id={request.request_id!r}: not waiting for KV here")
        rid, done = request.request_id, request.num_tokens
        request.num_computed_tokens = done
        self.blocks.release_outside(rid, done)  # before commit registers them
        self.blocks.commit(rid, request.token_ids, done, reservation.partial_blocks)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished(self) -> bool:
        """Whether a step has work: requests waiting or running (not those waiting for
        KV: their KV arrives without a step)."""
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish, abort, or the
        release of one waiting for KV)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.remote.pop(request.request_id, None)
        self.blocks.free(request.request_id)
        self.suspects.discard(request.request_id)

    def isolate(self, requests: list[Request]) -> None:
        """A step of these requests failed: free their blocks and queue them, in order,
        at the head of the queue as suspects, to be recomputed one at a time."""
        for request in reversed(requests):
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.blocks.free(request.request_id)
            request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
            self.waiting.appendleft(request)
            self.suspects.add(request.request_id)

    def cleared(self, request: Request) -> None:
        """A step of ``request`` alone sampled its next token: no longer a suspect."""
        self.suspects.discard(request.request_id)

    def schedule(self) -> ScheduledBatch:
        if self.suspects:
            return self._schedule_suspect()
        batch = ScheduledBatch()
        decodes = [r for r in self.running if r.num_pending_tokens == 1]
        prefills = [r for r in self.running if r.num_pending_tokens > 1]
        self._continue(decodes, self.max_batch_tokens, batch)  # a token each
        budget = prompt_budget(self.max_batch_tokens, len(batch.items), self.mixed_prefill_tokens)
        budget = self._continue(prefills, budget, batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            if batch.preempted:
                break  # the cache is full: admitting now would only preempt again
            request = self.waiting[0]
            if request.forks_now and len(self.running) + request.params.n > self.max_batch_size:
                break  # its choices join the batch at its first token: room for them all
            prefix = self._cached_prefix(request)
            done = request.num_computed_tokens + len(prefix) * self.blocks.block_size
            n = min(request.num_tokens - done, budget)
            if not self.blocks.can_allocate(request.request_id, done + n, prefix):
                break
            self.blocks.allocate(request.request_id, done + n, prefix)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(done, request.num_prompt_tokens)
                self.num_queried_tokens += request.num_prompt_tokens
                self.num_hit_tokens += request.num_cached_tokens
            request.num_computed_tokens = done
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.items.append((request, n))
            budget -= n
        return batch

    def _continue(self, requests: list[Request], budget: int, batch: ScheduledBatch) -> int:
        """Running ``requests``' next tokens (a decode or a prompt chunk each), in order,
        within ``budget``; what is left of it."""
        for request in requests:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.draft:  # a decode's guesses, as far as the budget has room
                request.draft = request.draft[: budget - 1]
            n = min(request.num_pending_tokens + len(request.draft), budget)
            if self._reserve(request, n, batch):
                batch.items.append((request, n))
                budget -= n
        return budget

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks a request without KV starts from (none when it has KV, or
        when its prompt's logprobs are to be computed: that takes the prompt's pass)."""
        if request.num_computed_tokens or request.wants_prompt_logprobs:
            return []
        return self.blocks.match(request.token_ids)

    def commit(self, batch: ScheduledBatch, prompt_tokens: int) -> None:
        """The step of ``batch`` ran, computing ``prompt_tokens`` prompt positions
        (``ScheduledBatch.prompt_tokens`` before it ran): register the blocks it filled in
        the prefix cache, then release those out of the window
        (``BlockManager.release_outside``)."""
        self.num_prompt_tokens_computed += prompt_tokens
        for request, _ in batch.items:
            rid, done = request.request_id, request.num_computed_tokens
            self.blocks.commit(rid, request.token_ids, done)
            self.blocks.release_outside(rid, done)

    def _schedule_suspect(self) -> ScheduledBatch:
        """A batch of one suspect (the oldest): a chunk of its recomputation, or its next
        token; newer running requests are preempted if it needs their blocks."""
        batch = ScheduledBatch()
        request = next(r for r in [*self.running, *self.waiting] if r.request_id in self.suspects)
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.insert(0, request)  # preempted last, if blocks run out
        n = min(request.num_pending_tokens, self.max_batch_tokens)
        if self._reserve(request, n, batch):
            batch.items.append((request, n))
        return batch

    def _reserve(self, request: Request, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for ``n`` more tokens of ``request``, preempting newer requests if needed."""
        total = request.num_computed_tokens + n
        while not self.blocks.can_allocate(request.request_id, total):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                if self._held_outside(request):
                    # blocks reserved for KV arriving from elsewhere come back as those
                    # requests land and end: this one waits for them, it is not too long
                    self._preempt(request, batch)
                    return False
                self.running.pop()
                batch.out_of_cache.append(request)
                return False
            self._preempt(victim, batch)
            if victim is request:
                return False
        self.blocks.allocate(request.request_id, total)
        return True

    def _held_outside(self, request: Request) -> bool:
        """Whether blocks held outside the running batch will come back: those of requests
        waiting for KV (they land and end, or are released) and those of hand-off
        requests that left, their KV being sent (``LLMEngine.release``)."""
        rid = request.request_id
        return any(self.blocks.num_held(o) for o in self.blocks.tables if o != rid)

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        request.draft = []
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        batch.preempted.append(request)
        batch.items = [(r, n) for r, n in batch.items if r is not request]
