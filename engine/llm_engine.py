"""One engine instance: requests in, a step at a time, outputs out.

``step()`` = schedule, run, postprocess. The serving workers drive it the same
way the offline ``LLM`` does. A step that raises fails only the request that
caused it (``StepFailed``): a failed step of several requests runs each of them
again alone first (engine/scheduler.py, ``isolate``), unless KV was being sent
during it (a hand-off's last chunk, engine/prefilled.py): then all of them fail.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import default_backend_name, get_backend
from engine.block_manager import BlockManager
from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.outputs import Logprobs, RequestOutput
from engine.parallel import SINGLE, TensorParallel
from engine.prefilled import LastChunkHook, Prefilled
from engine.request import Request, RequestStatus
from engine.sampler import Sample
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, StepShape
from engine.step_plan import StepPlan


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


class StepFailed(Exception):
    """A step of ``request_ids`` raised (the cause is chained): one request alone, or
    under tensor parallelism, where the ranks may be out of step, every request of it.
    Those requests are still in the engine; the caller fails (aborts) them."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"a step of {len(request_ids)} request(s) failed: {request_ids}")
        self.request_ids = request_ids


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
        self.scheduler = Scheduler(
            self.blocks, config.max_batch_tokens, config.max_batch_size, config.mixed_prefill_tokens
        )
        self.runner = ModelRunner(self.model, self.blocks, config.seed)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, Detokenizer] = {}
        self.last_shape: StepShape | None = None  # of the latest step's batch

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
    ) -> Request:
        """Queue a request (``hand_off``: it leaves at its first token, engine/prefilled.py).
        A resumed one (``delivered``: the output tokens its client
        already received, ``delivered_chars``: the characters of text it received) starts
        with that output: the scheduler prefills prompt + delivered (as it recomputes a
        preempted request), ``max_tokens`` and the stop checks count the delivered tokens,
        no output is emitted for them, and its next token and text are what an
        uninterrupted run would have produced after them (seeded draws are keyed by
        output position, ``engine.sampler``)."""
        ids = self.tokenize(prompt)
        request = self._admit(request_id, ids, params, delivered, delivered_chars)
        request.hand_off = hand_off
        self.scheduler.add(request)
        return request

    def add_prefilled(
        self,
        request_id: str,
        prompt_ids: list[int],
        first_token: int,
        params: SamplingParams,
        delivered: tuple[int, ...] = (),
        delivered_chars: int = 0,
        first_logprobs: Logprobs | None = None,
        partial_blocks: int = 0,
    ) -> RequestOutput:
        """Admit a request prefilled elsewhere: the KV of its prompt + ``delivered`` (see
        ``add_request``) already sits in the blocks this engine holds for ``request_id``
        (reserved with ``blocks.allocate`` and filled by the KV transfer; its first
        ``partial_blocks`` table entries, which some layer did not receive, are never
        registered), and ``first_token`` was sampled there at output position
        ``len(delivered)`` (with ``first_logprobs``, required exactly when
        ``params.logprobs`` is set). Returns that token's output (it may end the request)."""
        cached = len(prompt_ids) + len(delivered)
        have, need = len(self.blocks.block_table(request_id)), self.blocks.blocks_for(cached)
        if have != need:
            raise ValueError(
                f"request {request_id!r}: {cached} prompt and delivered tokens need {need} "
                f"reserved blocks, {have} are held"
            )
        if (first_logprobs is None) != (params.logprobs is None):
            raise ValueError(
                f"request {request_id!r}: logprobs={params.logprobs!r} but the first token "
                f"came {'without' if first_logprobs is None else 'with'} logprobs"
            )
        request = self._admit(request_id, prompt_ids, params, delivered, delivered_chars)
        request.num_computed_tokens = cached
        self.blocks.release_outside(request_id, cached)  # before commit registers them
        self.blocks.commit(request_id, request.token_ids, cached, partial_blocks)
        self.scheduler.add_running(request)
        return self._append(Sample(request, first_token, first_logprobs))

    def _admit(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        delivered: tuple[int, ...],
        delivered_chars: int,
    ) -> Request:
        """The checked ``Request`` and its detokenizer, registered under ``request_id``
        (not yet scheduled)."""
        delivered = tuple(delivered)
        self.validate_prompt(ids, delivered)
        params.validate()
        self._validate_delivered(delivered, params)
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: already in use")
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, params.stop, delivered, delivered_chars)
        elif delivered_chars:
            raise ValueError(
                f"delivered_chars={delivered_chars}: this model has no tokenizer, so no "
                "text was delivered; must be 0"
            )
        request = Request(request_id, ids, params, delivered=delivered)
        self.requests[request_id] = request
        if detok is not None:
            self.detokenizers[request_id] = detok
        return request

    def _validate_delivered(self, delivered: tuple[int, ...], params: SamplingParams) -> None:
        """A resumed request has output left to generate: fewer delivered tokens than
        ``max_tokens``, none of them one that ends the request."""
        if len(delivered) >= params.max_tokens:
            raise ValueError(
                f"delivered: {len(delivered)} tokens, max_tokens={params.max_tokens}; "
                "a resumed request must have fewer (it would already have finished)"
            )
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.model_config.eos_token_ids)
        ended = next((t for t in delivered if t in stops), None)
        if ended is not None:
            raise ValueError(
                f"delivered: holds token {ended}, which stops this request (stop_token_ids "
                "or EOS); a request that stopped cannot be resumed"
            )

    def validate_prompt(self, ids: list[int], delivered: tuple[int, ...] = ()) -> None:
        """A prompt (and a resumed request's ``delivered`` output) that can run here: in
        the vocabulary, leaving room in the context and the KV cache for one more token."""
        if not ids:
            raise ValueError("prompt: empty; give at least one token")
        what = "prompt" if not delivered else f"prompt + delivered ({len(delivered)})"
        total = len(ids) + len(delivered)
        if total >= self.max_context:
            raise ValueError(
                f"{what}: {total} tokens, the context holds {self.max_context} "
                "(they must leave room for one generated token)"
            )
        if self.blocks.blocks_for(total + 1) > self.blocks.num_blocks:
            raise ValueError(
                f"{what}: {total} tokens need more than the {self.blocks.num_blocks} "
                f"KV blocks of {self.blocks.block_size} tokens this engine has"
            )
        vocab = self.model_config.vocab_size
        for key, values in (("prompt", ids), ("delivered", delivered)):
            if values and (min(values) < 0 or max(values) >= vocab):
                raise ValueError(f"{key}: token ids must be in [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.remove(request)
        self.detokenizers.pop(request_id, None)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (they leave their step loop)."""
        if self.model.tp.size > 1:
            StepPlan.stop(self.model.tp)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def release(self, request_id: str) -> None:
        """Free the blocks of a hand-off request that left (its transfer is over)."""
        self.blocks.free(request_id)

    def step(self, on_last_chunk: LastChunkHook | None = None) -> list[RequestOutput | Prefilled]:
        """One step: a ``RequestOutput`` per request that got a token, a ``Prefilled`` per
        hand-off request that left. ``on_last_chunk`` (engine/prefilled.py): the hook of
        hand-off requests' last chunks, given while there are any (their prefill is
        timed then too)."""
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
            sampled = self.runner.run(batch, on_layer, extra)
            self.scheduler.commit(batch)
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
        outputs += [self._leave(s) if s.request.hand_off else self._append(s) for s in sampled]
        return outputs

    def _leave(self, sample: Sample) -> Prefilled:
        """A hand-off request's first token: it leaves the scheduler and the engine,
        keeping its blocks (engine/prefilled.py)."""
        request = sample.request
        request.token_ids.append(sample.token)
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
        )

    def _append(self, sample: Sample) -> RequestOutput:
        """The sampled token joins its request's output; the output (maybe the last)."""
        request = sample.request
        request.token_ids.append(sample.token)
        if request.logprobs is not None:
            request.logprobs.append(sample.logprobs)
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
        if not p.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_context:
            return "length"
        return None

    def _finish(self, request: Request, reason: str, new_ids: list[int]) -> RequestOutput:
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.scheduler.remove(request)
        out = self._output(request, new_ids, final=True)
        del self.requests[request.request_id]
        self.detokenizers.pop(request.request_id, None)
        return out

    def _output(self, request: Request, new_ids: list[int], final: bool) -> RequestOutput:
        detok, lps = self.detokenizers.get(request.request_id), request.logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detok.text if detok else "",
            new_token_ids=new_ids,
            new_text=detok.delta(final) if detok else "",
            finish_reason=request.finish_reason,
            logprobs=None if lps is None else list(lps),
            new_logprobs=None if lps is None else lps[len(lps) - len(new_ids) :],
            num_cached_tokens=max(0, request.num_cached_tokens),
        )
