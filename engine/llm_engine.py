"""One engine instance: requests in, a step at a time, outputs out.

``step()`` = schedule, run, postprocess. The serving workers drive it the same
way the offline ``LLM`` does. A step that raises fails only the request that
caused it (``StepFailed``): a failed step of several requests runs each of them
again alone first (engine/scheduler.py, ``isolate``), unless KV was being sent
during it (a hand-off's last chunk, engine/prefilled.py): then all of them fail.

A request whose KV another instance computes is ``reserve``d (engine/reservation.py),
its KV written into the reservation's blocks through ``kv_view``, then ``land``ed, or
``release``d. Callers reach the scheduler, the block manager and the runner only
through these methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.engine.attention import default_backend_name, get_backend
from pdserve.engine.block_manager import BlockManager, CacheEvents
from pdserve.engine.checkpoint import load_checkpoint
from pdserve.engine.choices import abort_unforked, drop, fork, name
from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.engine_stats import EngineStats
from pdserve.engine.guessers import make_guesser
from pdserve.engine.kv_view import KVView
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import Logprobs, RequestOutput, StepFailed
from pdserve.engine.parallel import SINGLE, TensorParallel
from pdserve.engine.prefilled import LastChunkHook, Prefilled
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.request_checks import check_delivered, check_prompt
from pdserve.engine.reservation import NoRoom, Reservation
from pdserve.engine.sampler import Sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler, StepShape
from pdserve.engine.speculative import draft_length, drafts_for, guesses_per_request
from pdserve.engine.step_plan import StepPlan
from pdserve.engine.structured import Grammars, llg_tokenizer


def load_model(model: str, config: EngineConfig, tp: TensorParallel = SINGLE):
    """The checkpoint and this rank's shard of its model, weights sliced while loading."""
    config.validate()
    device = torch.device(config.device)
    attn, ops = get_backend(config.attention_backend or default_backend_name(device))
    ckpt = load_checkpoint(model)
    with torch.device(device):
        shard = LlamaModel(ckpt.config, attn, ops, config.torch_dtype, tp)
    shard.load_weights(ckpt.weights(config.torch_dtype))
    shard.prepare_weights()
    return ckpt, shard


log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str, config: EngineConfig, tp: TensorParallel = SINGLE):
        self.config = config
        ckpt, self.model = load_model(model, config, tp)
        self.model_config, self.tokenizer = ckpt.config, ckpt.tokenizer
        # a model whose every layer slides (Mistral, Phi-3) frees the blocks before the
        # window of each request's next token (engine/block_manager.py)
        self.blocks = BlockManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            window=self.model.cfg.cache_window,
        )
        cfg = self.model.cfg
        self.scheduler = Scheduler(
            self.blocks,
            config.max_batch_tokens,
            config.max_batch_size,
            config.mixed_prefill_tokens,
            tuple(cfg.window(layer) for layer in range(cfg.num_layers)),
        )
        self.runner = ModelRunner(self.model, self.blocks, config.seed)
        # the requests a step may run (waiting or running; not those waiting for KV)
        self.requests: dict[str, Request] = {}
        # choices not forked yet, by id: the request that forks them (engine/choices.py)
        self.unforked: dict[str, Request] = {}
        # named choices dropped unforked since the caller last took them (engine/choices.py)
        self.orphaned: list[str] = []
        self.guesser = make_guesser(config.speculative_method)  # engine/guessers.py
        self.detokenizers: dict[str, Detokenizer] = {}
        self.last_shape: StepShape | None = None  # of the latest step's batch
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    @property
    def max_context(self) -> int:
        return self.model_config.max_position

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        delivered: tuple[int, ...] = (),
        delivered_chars: int = 0,
        hand_off: bool = False,
        choice_ids: Sequence[str] = (),
    ) -> Request:
        """Queue a request (``hand_off``: it leaves at its first token, engine/prefilled.py,
        its other choices' first tokens with it; ``choice_ids``: the ids of its choices
        1 .. n - 1, each a request of its own once forked, engine/choices.py).
        A resumed one (``delivered``: the output tokens its client
        already received, ``delivered_chars``: the characters of text it received) starts
        with that output: the scheduler prefills prompt + delivered (as it recomputes a
        preempted request), ``max_tokens`` and the stop checks count the delivered tokens,
        no output is emitted for them, and its next token and text are what an
        uninterrupted run would have produced after them (seeded draws are keyed by
        output position, ``engine.sampler``)."""
        ids = self.tokenize(prompt)
        request, detok = self._new_request(
            request_id, ids, params, delivered, delivered_chars, () if hand_off else choice_ids
        )
        self.requests[request_id] = request
        if detok is not None:
            self.detokenizers[request_id] = detok
        request.hand_off = hand_off
        self.scheduler.add(request)
        return request

    def reserve(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        delivered: tuple[int, ...] = (),
        delivered_chars: int = 0,
        choice_ids: Sequence[str] = (),
    ) -> Reservation | NoRoom:
        """Take a request whose KV another instance computes (engine/reservation.py): the
        KV of its prompt + ``delivered`` (see ``add_request``) is to be written into the
        reservation's ``block_ids``; then ``land``, or ``release``. ``NoRoom`` when the
        batch or the cache has none now (``Scheduler.admit_remote``). Raises ValueError
        (nothing held) for a request ``add_request`` would refuse or an id in use. Its
        choices (``choice_ids`` as ``add_request``'s) fork when it lands."""
        request, detok = self._new_request(
            request_id, prompt_ids, params, delivered, delivered_chars, choice_ids
        )
        got = self.scheduler.admit_remote(request)
        if not isinstance(got, Reservation):  # the caller may try again, choices and all
            drop(self, request, ended=False)
        elif detok is not None:
            self.detokenizers[request_id] = detok
        return got

    def land(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: Logprobs | None = None,
        prompt_logprobs: list[Logprobs | None] | None = None,
        choices: Sequence[tuple[int, Logprobs | None]] = (),
    ) -> list[RequestOutput]:
        """The reserved KV of ``request_id`` is in its blocks, and ``first_token`` was
        sampled where it was computed, at output position ``len(delivered)`` (with
        ``first_logprobs``, required exactly when the request asked for logprobs, and the
        whole ``prompt_logprobs``, exactly when it asked for those and had no delivered
        output), with ``choices``, choices 1 .. n - 1's first tokens (and logprobs): the
        request and its choices, forked now, run from the next step. Returns those
        tokens' outputs, the request's last (they may end it). Raises ValueError for an
        id that waits for no KV here, or logprobs or choices that do not match the
        request's (then it is released)."""
        request = self.scheduler.remote.get(request_id)
        if request is None:
            raise ValueError(f"request_id={request_id!r}: no reservation waits for KV here")
        if (first_logprobs is None) != (request.params.logprobs is None):
            self.release(request_id)
            raise ValueError(
                f"request {request_id!r}: logprobs={request.params.logprobs!r} but the first "
                f"token came {'without' if first_logprobs is None else 'with'} logprobs"
            )
        wanted = None if request.prompt_logprobs is None else request.num_prompt_tokens
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        if got != wanted:
            self.release(request_id)
            raise ValueError(
                f"request {request_id!r}: prompt_logprobs={request.params.prompt_logprobs!r} "
                f"wants {wanted} prompt entries, the handoff carried {got}"
            )
        if len(choices) != request.params.n - 1:
            self.release(request_id)
            raise ValueError(
                f"request {request_id!r}: n={request.params.n} but the handoff carried "
                f"{len(choices)} other choices' first tokens"
            )
        request.prompt_logprobs = prompt_logprobs
        self.scheduler.land(request)
        self.requests[request_id] = request
        sample = Sample(request, first_token, first_logprobs, choices=list(choices))
        outputs = [self._append(c) for c in fork(self, sample)] if choices else []
        return [*outputs, self._append(sample)]

    def _new_request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        delivered: tuple[int, ...],
        delivered_chars: int,
        choice_ids: Sequence[str] = (),
    ) -> tuple[Request, Detokenizer | None]:
        """The checked ``Request`` and its detokenizer (None without a tokenizer), its
        choices named (engine/choices.py); ValueError naming what is refused, an id in
        use here included."""
        delivered, b, m = tuple(delivered), self.blocks, self.model_config
        check_prompt(ids, delivered, self.max_context, b.num_blocks, b.block_size, m.vocab_size)
        params.validate()
        if params.n > self.config.max_batch_size:
            raise ValueError(
                f"n={params.n}: more choices than this engine runs at once "
                f"(max_batch_size={self.config.max_batch_size})"
            )
        check_delivered(delivered, params, m.eos_token_ids)
        if self.owns(request_id):
            raise ValueError(f"request_id={request_id!r}: already in use")
        if params.n > 1 and delivered:
            raise ValueError(f"n={params.n}: a resumed request (delivered tokens) has one choice")
        matcher = None
        if params.guide is not None:  # a resumed request's grammar has read its delivered
            matcher = self.grammars().matcher(params.guide, delivered)
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, params.stop, delivered, delivered_chars)
        elif delivered_chars:
            raise ValueError(
                f"delivered_chars={delivered_chars}: this model has no tokenizer, so no "
                "text was delivered; must be 0"
            )
        request = Request(request_id, ids, params, delivered=delivered)
        request.matcher = matcher
        if params.n > 1:
            name(self, request, choice_ids)
        return request, detok

    def grammars(self) -> Grammars:
        """The compiled guides of this engine's tokenizer (built at the first guided
        request, or ``prepare_guide``); thread-safe. ValueError without a tokenizer."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("guide: this model has no tokenizer to match a grammar with")
                vocab = self.model_config.vocab_size
                self._grammars = Grammars(llg_tokenizer(self.tokenizer, vocab))
            return self._grammars

    def prepare_guide(self, params: SamplingParams) -> None:
        """Compile ``params.guide`` now, from any thread, so that the step loop that
        admits the request finds it compiled; ValueError (GuideError) when it does not
        compile."""
        if params.guide is not None:
            self.grammars().compile(params.guide)

    def owns(self, request_id: str) -> bool:
        """The id is in use here: a request of the batch, waiting for KV, or an unforked
        choice."""
        return (
            request_id in self.requests
            or request_id in self.scheduler.remote
            or request_id in self.unforked
        )

    def abort_request(self, request_id: str) -> None:
        """Drop a request of the batch (waiting or running; one waiting for KV is
        ``release``d instead, once its transfer writes no more): its blocks are freed.
        An unforked choice will not fork."""
        if abort_unforked(self, request_id):
            return
        choices = [rid for rid, r in self.requests.items() if r.parent_id == request_id]
        for rid in (request_id, *choices):  # its other choices too, once forked
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            drop(self, request)
            self._ended(request)
            self.scheduler.remove(request)
            self.detokenizers.pop(rid, None)
            request.status, request.finish_reason = RequestStatus.FINISHED, "abort"

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (they leave their step loop)."""
        if self.model.tp.size > 1:
            StepPlan.stop(self.model.tp)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_prompts_to_compute(self) -> bool:
        """Whether a request waits, or runs part-way through its prompt (the benchmarks
        step until only decodes remain)."""
        s = self.scheduler
        return bool(s.waiting) or any(r.num_pending_tokens > 1 for r in s.running)

    def release(self, request_id: str) -> None:
        """Free the blocks of a hand-off request that left (its transfer is over), or drop
        a reservation that did not land (no byte of its transfer lands after this); a
        no-op for an id that holds no blocks."""
        request = self.scheduler.remote.get(request_id)
        if request is None:
            self.blocks.free(request_id)
            return
        drop(self, request)
        self.scheduler.remove(request)
        self.detokenizers.pop(request_id, None)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"

    def copy_landed(self, request_id: str) -> None:
        """Tensor parallelism, rank 0: the reserved blocks of ``request_id``, waiting for
        KV (which landed here alone: a replicated MLA latent), into the same blocks of
        every other rank, between steps, before it lands (``StepPlan.copy_blocks``)."""
        reservation = self.scheduler.remote[request_id].reservation
        assert reservation is not None  # set by admit_remote for every remote request
        self.runner.copy_blocks(list(reservation.block_ids))

    def kv_view(self) -> KVView:
        """The cache's tensors and block tables, for the KV transfer (engine/kv_view.py)."""
        return KVView(self.runner, self.blocks)

    def stats(self) -> EngineStats:
        s, b = self.scheduler, self.blocks
        return EngineStats(
            waiting=len(s.waiting),
            running=len(s.running),
            waiting_for_kv=len(s.remote),
            free_blocks=b.num_free_blocks,
            total_blocks=b.num_blocks,
            cached_blocks=b.num_cached_blocks,
            preemptions=s.num_preemptions,
            queried_tokens=s.num_queried_tokens,
            hit_tokens=s.num_hit_tokens,
            computed_prompt_tokens=s.num_prompt_tokens_computed,
        )

    def check_integrity(self) -> None:
        """The block manager's ``check_integrity``, every request waiting for KV holds its
        reservation's blocks, and every unforked choice's request is here; AssertionError
        naming what disagrees."""
        self.blocks.check_integrity()
        for rid, request in self.scheduler.remote.items():
            held, reservation = self.blocks.block_table(rid), request.reservation
            if reservation is None or tuple(held[-len(reservation.block_ids) :]) != (
                reservation.block_ids
            ):
                raise AssertionError(f"{rid!r}: holds {held}, reserved {reservation}")
        for choice, request in self.unforked.items():  # engine/choices.py
            rid = request.request_id
            if choice not in request.choice_ids or not (
                self.requests.get(rid) is request or self.scheduler.remote.get(rid) is request
            ):
                raise AssertionError(f"unforked choice {choice!r} of {rid!r}, which is not here")

    def take_cache_events(self) -> CacheEvents:
        """The prefix cache's changes since the last call (``BlockManager.take_events``)."""
        return self.blocks.take_events()

    def step(self, on_last_chunk: LastChunkHook | None = None) -> list[RequestOutput | Prefilled]:
        """One step: a ``RequestOutput`` per request that got a token, a ``Prefilled`` per
        hand-off request that left. ``on_last_chunk`` (engine/prefilled.py): the hook of
        hand-off requests' last chunks, given while there are any (their prefill is
        timed then too)."""
        if self.config.speculative_tokens:
            self._draft()
        batch = self.scheduler.schedule()
        self.last_shape = batch.shape() if batch else None
        on_layer, extra = None, b""
        if on_last_chunk is not None:  # only while hand-off requests are here
            now, last = time.time(), []
            for r, n in batch.items:
                if r.hand_off:
                    r.started_s = r.started_s or now
                    if r.num_computed_tokens + n == r.num_tokens:
                        last.append(r)
            if last:
                on_layer, extra = on_last_chunk(last)
        sampled = self._run(batch, on_layer, extra)
        return self._postprocess(batch, sampled)

    def _run(self, batch: ScheduledBatch, on_layer=None, extra: bytes = b"") -> list:
        """``runner.run(batch, ...)``; when it raises, a batch of several requests is
        isolated (each recomputed alone, nothing sampled now) and one of a single
        request raises ``StepFailed``."""
        if not batch:
            return []
        try:
            prompt = batch.prompt_tokens()
            sampled = self.runner.run(batch, on_layer, extra)
            self.scheduler.commit(batch, prompt)
        except Exception as e:
            requests = [r for r, _ in batch.items]
            if len(requests) == 1 or self.model.tp.size > 1 or on_layer is not None:
                raise StepFailed([r.request_id for r in requests]) from e
            log.warning(
                "a step of %d requests failed; running each alone to find the cause",
                len(requests),
                exc_info=True,
            )
            self.scheduler.isolate(requests)
            return []
        if self.scheduler.suspects:
            for sample in sampled:
                self.scheduler.cleared(sample.request)
        return sampled

    def _postprocess(self, batch: ScheduledBatch, sampled) -> list[RequestOutput | Prefilled]:
        outputs: list[RequestOutput | Prefilled] = []
        for request in batch.out_of_cache:
            if request.hand_off:
                self.abort_request(request.request_id)
                why = "the prompt does not fit in this instance's KV cache"
                outputs.append(Prefilled(request, 0, [], error=why))
            else:
                outputs.append(self._finish(request, "length", []))
        for s in sampled:
            if s.request.hand_off:
                outputs.append(self._leave(s))
                continue
            if s.choices:  # forked first: its own token may end it, and free what they share
                outputs += [self._append(choice) for choice in fork(self, s)]
            outputs.append(self._append(s))
            for token in s.more:  # a speculative step's confirmed tokens, while it runs
                if s.request.finished:
                    break
                outputs.append(self._append(Sample(s.request, token)))
        return outputs

    def _leave(self, sample: Sample) -> Prefilled:
        """A hand-off request's first token: it leaves the scheduler and the engine,
        keeping its blocks (engine/prefilled.py)."""
        request = sample.request
        request.token_ids.append(sample.token)
        drop(self, request, ended=False)  # its choices fork where it lands
        self.scheduler.running.remove(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        self.detokenizers.pop(request.request_id, None)
        end = time.time()
        return Prefilled(
            request,
            sample.token,
            list(self.blocks.block_table(request.request_id)),
            {"prefill_start": request.started_s or end, "prefill_end": end},
            logprobs=sample.logprobs,
            cached_tokens=max(0, request.num_cached_tokens),
            prompt_logprobs=self._take_prompt_logprobs(request),
            choices=sample.choices,
        )

    def _append(self, sample: Sample) -> RequestOutput:
        """The sampled token joins its request's output; the output (maybe the last)."""
        request = sample.request
        request.token_ids.append(sample.token)
        if request.logprobs is not None:
            request.logprobs.append(sample.logprobs)
        if request.matcher is not None:
            request.matcher.consume(sample.token)
            if (why := request.matcher.error) is not None:  # a dead end: not emitted
                kind, n = request.params.guide.kind, request.num_output_tokens - 1
                error = (
                    f"the {kind} guide: after {n} output tokens no token of the model's "
                    f"vocabulary can follow it ({why})"
                )
                return self._finish(request, "abort", [], error)
        reason = self._check_stop(request, sample.token)
        if reason is not None:
            return self._finish(request, reason, [sample.token])
        return self._output(request, [sample.token], final=False)

    def _check_stop(self, request: Request, token: int) -> str | None:
        p = request.params
        detok = self.detokenizers.get(request.request_id)
        if detok is not None and detok.update(request.output_token_ids) is not None:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if request.matcher is not None and request.matcher.done:
            return "stop"  # the grammar is complete: only an end of sequence may follow
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_context:
            return "length"
        return None

    def _finish(
        self, request: Request, reason: str, new_ids: list[int], error: str | None = None
    ) -> RequestOutput:
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        drop(self, request)
        self._ended(request)
        self.scheduler.remove(request)
        out = self._output(request, new_ids, final=True)
        out.error = error
        del self.requests[request.request_id]
        self.detokenizers.pop(request.request_id, None)
        return out

    def _ended(self, request: Request) -> None:
        """``request`` left the batch for good: its guesser's to know."""
        if self.config.speculative_tokens:
            self.guesser.ended(request)

    def _draft(self) -> None:
        """Each running request's guesses for this step (engine/speculative.py), within
        what its ``max_tokens`` and the context leave after its pending token."""
        context, running = self.max_context, self.scheduler.running
        k = guesses_per_request(self.config.speculative_tokens, len(running))
        if k == 0:  # a batch too large to guess for: none of its requests has a draft
            for r in running:
                r.draft = []
            return
        for r in running:
            room = min(k, r.params.max_tokens - r.num_output_tokens - 1, context - r.num_tokens - 1)
            ok = room > 0 and drafts_for(r, k, context)
            length = min(room, draft_length(r.guesses, k)) if ok else 0
            r.draft = self.guesser.guess(r, length) if length else []
            if ok and not length:  # its guesses did not pay lately
                r.guesses.idle += 1

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> list[Logprobs | None] | None:
        """The request's prompt logprobs once all are computed, taken from it (its first
        output carries them, and no later one); else None."""
        lps = request.prompt_logprobs
        if lps is None or len(lps) < request.num_prompt_tokens:
            return None
        request.prompt_logprobs = None
        return lps

    def _output(self, request: Request, new_ids: list[int], final: bool) -> RequestOutput:
        detok, lps = self.detokenizers.get(request.request_id), request.logprobs
        g = request.guesses
        return RequestOutput(
            request_id=request.parent_id or request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detok.text if detok else "",
            new_token_ids=new_ids,
            new_text=detok.delta(final) if detok else "",
            finish_reason=request.finish_reason,
            logprobs=None if lps is None else list(lps),
            new_logprobs=None if lps is None else lps[len(lps) - len(new_ids) :],
            num_cached_tokens=max(0, request.num_cached_tokens),
            prompt_logprobs=self._take_prompt_logprobs(request),
            index=request.index,
            guesses=(g.guessed, g.accepted, g.steps) if final else (0, 0, 0),
        )
