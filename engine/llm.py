"""Offline generation in one process, with the names vLLM users expect."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.parallel import SINGLE, check_degree
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM("smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=32))``."""

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        block_size: int = 16,
        num_kv_blocks: int = 2048,
        max_batch_tokens: int = 512,
        max_batch_size: int = 64,
        mixed_prefill_tokens: int | None = None,
        attention_backend: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        tensor_parallel: int = 1,
        enable_prefix_caching: bool = True,
        speculative_tokens: int = 0,
        speculative_method: str = "ngram",
    ):
        """``tensor_parallel=N`` runs ranks 1..N-1 as local processes (gloo on CPU): each
        process, this one included, holds 1/N of the heads, the MLP and the KV cache and
        uses cpu_count/N torch threads (restored in this process at ``close()``).
        ``close()`` (or ``with LLM(...)``) stops them. ``speculative_tokens=k`` verifies
        up to k guesses per decode step (engine/speculative.py), taken by
        ``speculative_method`` (engine/guessers.py: ngram or suffix)."""
        config = EngineConfig(
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_batch_tokens=max_batch_tokens,
            max_batch_size=max_batch_size,
            mixed_prefill_tokens=mixed_prefill_tokens,
            attention_backend=attention_backend,
            device=device,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            speculative_tokens=speculative_tokens,
            speculative_method=speculative_method,
        )
        self._ranks = None
        tp = SINGLE
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={tensor_parallel!r}: must be a positive integer")
        if tensor_parallel > 1:
            from pdserve.engine.checkpoint import load_checkpoint
            from pdserve.engine.tp_rank import LocalRanks, threads_per_rank

            config.validate()
            check_degree(load_checkpoint(model).config, tensor_parallel)
            threads = threads_per_rank(tensor_parallel)
            self._caller_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            self._ranks = LocalRanks(model, config, tensor_parallel, threads)
            tp = self._ranks.tp
        try:
            self.engine = LLMEngine(model, config, tp)
        except BaseException:
            if self._ranks is not None:
                self._ranks.join(timeout_s=0)
                torch.set_num_threads(self._caller_threads)
            raise
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel rank processes (nothing to do with one rank)."""
        if self._ranks is not None:
            self.engine.close()
            self._ranks.join()
            self._ranks = None
            torch.set_num_threads(self._caller_threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_ranks", None) is not None and hasattr(self, "engine"):
            self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt and choice, in order (its final one, choice 0's with the
        ``prompt_logprobs`` its first carried): a prompt whose params ask for ``n``
        choices gives n outputs, ``index`` 0 .. n - 1. A prompt is a string or a list of
        token ids."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(params_list)} given for {len(prompts)} prompts"
            )
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
                self.engine.add_request(request_id, prompt, p)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        done: dict[tuple[str, int], RequestOutput] = {}
        prompt_logprobs: dict[str, list] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    if out.index == 0:
                        out.prompt_logprobs = prompt_logprobs.get(out.request_id)
                    done[out.request_id, out.index] = out
        pairs = zip(ids, params_list, strict=True)
        return [done[i, c] for i, p in pairs for c in range(p.n)]

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like ``generate`` on each conversation rendered by the model's chat template."""
        if self.tokenizer is None:
            raise ValueError("conversations: this model has no tokenizer")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params)
