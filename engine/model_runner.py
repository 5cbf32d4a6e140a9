"""Turns a scheduled batch into tensors, runs the model, and samples (the data plane)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model import LlamaModel
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sample, Sampler, prompt_logprobs
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.speculative import accepted, verified
from pdserve.engine.step_plan import StepPlan

LOGITS_ROWS = 512  # rows of logits computed at once: 512 x 49152 float32 is 96 MiB


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU from an anonymous mapping, so untouched pages cost nothing,
    asking for transparent huge pages: decode reads every sequence's blocks each step,
    and with 4 KiB pages the TLB misses cost the decode attention at batch 32 ~15% here."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaModel, blocks: BlockManager, seed: int = 0):
        self.model, self.blocks = model, blocks
        cfg, dev = model.cfg, model.embed.device
        blocks_shape = (cfg.num_layers, blocks.num_blocks, blocks.block_size)
        if cfg.mla is not None:
            # [layers, blocks, block size, Hc * Dc + Dr]: each token's latent/tied heads
            # (this rank's; MLA's one latent on every rank), then its RoPE key
            width = model.layers[0].mla.cache_width
            self.kv_cache = zeros((*blocks_shape, width), model.dtype, dev)
            self.kv_caches = list(self.kv_cache)
            self.block_axis = 1
        else:
            layer = model.layers[0]
            shape = (*blocks_shape[1:], layer.num_kv_heads, cfg.head_dim)
            # [layers, 2 (k, v), blocks, block size, kv heads, head dim], one allocation
            self.kv_cache = zeros((cfg.num_layers, 2, *shape), model.dtype, dev)
            self.kv_caches = [(kv[0], kv[1]) for kv in self.kv_cache]
            self.block_axis = 2
        # this rank's cache bytes per token, all layers (MLA: the replicated latent row)
        tokens = blocks.num_blocks * blocks.block_size
        self.kv_bytes_per_token = self.kv_cache.numel() // tokens * model.dtype.itemsize
        self.sampler = Sampler(seed)
        self.device = dev

    def prepare(self, items: list[tuple[Request, int]]):
        """input_ids, positions [T] and the attention metadata, prefills ordered first.
        A verified request's pending token and draft (engine/speculative.py) are n
        sequences of one query token each, over its table, up to their own positions.

        Returns the reordered items too: row order of the batch follows them.
        """
        items = sorted(items, key=lambda item: item[1] == 1 or verified(*item))
        bs = self.blocks.block_size
        ids, positions, slots, starts, lens, qlens, tables = [], [], [], [0], [], [], []
        for request, n in items:
            begin = request.num_computed_tokens
            table = self.blocks.block_table(request.request_id)
            if verified(request, n):
                ids.extend([request.token_ids[begin], *request.draft])
                for p in range(begin, begin + n):
                    positions.append(p)
                    slots.append(table[p // bs] * bs + p % bs)
                    starts.append(starts[-1] + 1)
                    lens.append(p + 1)
                    qlens.append(1)
                    tables.append(table)
                continue
            ids.extend(request.token_ids[begin : begin + n])
            pos = range(begin, begin + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            starts.append(starts[-1] + n)
            lens.append(begin + n)
            qlens.append(n)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            query_start_loc=tensor(starts, torch.int32),
            seq_lens=tensor(lens, torch.int32),
            block_tables=tensor(padded, torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            num_decodes=sum(1 for q in qlens if q == 1),
            max_query_len=max(qlens),
            max_seq_len=max(lens),
            query_lens_host=qlens,
            seq_lens_host=lens,
        )
        return items, tensor(ids, torch.int64), tensor(positions, torch.int64), meta

    def run(
        self,
        batch: ScheduledBatch,
        on_layer: Callable[[int], None] | None = None,
        extra: bytes = b"",
    ) -> list[Sample]:
        """One forward pass; returns the ``Sample`` (next token, and its logprobs when
        asked) of each request whose pass reached the end of its known tokens (the others
        are part-way through a prompt).
        With tensor parallelism, this is rank 0: the plan goes to the other ranks first.
        ``on_layer``: see ``LlamaModel.forward``; ``extra``: see ``StepPlan``."""
        items, input_ids, positions, meta = self.prepare(batch.items)
        rows, sampled, prompt_rows, scored = [], [], [], []
        spec_rows, spec = [], []  # verified requests' rows; (request, its first position)
        end = 0
        for request, n in items:
            begin = request.num_computed_tokens
            if verified(request, n):
                spec_rows.extend(range(end, end + n))
                spec.append((request, begin))
                end += n
                continue
            request.draft = []
            if request.wants_prompt_logprobs:
                # position p's logits score prompt token p + 1; the ones scored so far skip
                first = len(request.prompt_logprobs) - 1
                assert first >= begin, "a prompt's logprobs are computed in order"
                for p in range(first, min(begin + n, request.num_prompt_tokens - 1)):
                    prompt_rows.append(end + p - begin)
                    scored.append((request, request.prompt_token_ids[p + 1]))
            end += n
            if begin + n == request.num_tokens:
                rows.append(end - 1)
                sampled.append(request)
        plan = StepPlan(input_ids, positions, meta, rows + spec_rows + prompt_rows, extra)
        if self.model.tp.size > 1:
            plan.broadcast(self.model.tp)
        sample_logits: list[torch.Tensor] = []
        spec_logits: list[torch.Tensor] = []
        verified_end = len(rows) + len(spec_rows)

        def take(first: int, logits: torch.Tensor) -> None:
            last = first + len(logits)
            groups = ((0, len(rows), sample_logits), (len(rows), verified_end, spec_logits))
            for lo, hi, parts in groups:
                if max(first, lo) < min(last, hi):
                    parts.append(logits[max(first, lo) - first : min(last, hi) - first])
            k = max(0, min(verified_end - first, len(logits)))
            if k < len(logits):  # prompt rows: their logprobs join their requests'
                lo = first + k - verified_end
                part = scored[lo : lo + len(logits) - k]
                targets = [target for _, target in part]
                ks = [r.params.prompt_logprobs for r, _ in part]
                found = prompt_logprobs(logits[k:], targets, ks)
                for (r, _), lp in zip(part, found, strict=True):
                    r.prompt_logprobs.append(lp)

        self.execute(plan, on_layer, take)
        for request, n in items:
            request.num_computed_tokens += n
        out = self._verify(torch.cat(spec_logits), spec) if spec else []
        if not sampled:
            return out
        logits = sample_logits[0] if len(sample_logits) == 1 else torch.cat(sample_logits)
        return self.sampler.sample(logits, sampled) + out

    def _verify(self, logits: torch.Tensor, spec: list[tuple[Request, int]]) -> list[Sample]:
        """The verified requests' samples (engine/speculative.py): each one's tokens over
        its rows of ``logits`` (greedy, or drawn as plain sampling would:
        ``Sampler.verify``), its draft's accepted prefix and the token after it; its
        computed tokens rolled back to the accepted positions."""
        targets, out, at = logits.argmax(dim=-1).tolist(), [], 0
        for request, begin in spec:
            n = 1 + len(request.draft)
            if request.params.greedy:
                mine = targets[at : at + n]
            else:
                mine = self.sampler.verify(logits[at : at + n], request)
            at += n
            a = accepted(request.draft, mine)
            request.guesses.verified(len(request.draft), a)
            request.num_computed_tokens = begin + 1 + a
            request.draft = []
            out.append(Sample(request, mine[0], more=mine[1 : a + 1]))
        return out

    def copy_blocks(self, block_ids: list[int]) -> None:
        """Rank 0: the cache's blocks ``block_ids`` into the same blocks of every other
        rank, between steps (``StepPlan.copy_blocks``; a no-op without other ranks)."""
        StepPlan.copy_blocks(self.model.tp, self.kv_cache, self.block_axis, block_ids)

    def fork_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Rank 0, between steps: copy block ``src`` of the cache into block ``dst`` for
        each pair, on every rank (``StepPlan.fork_blocks``)."""
        StepPlan.fork_blocks(self.model.tp, self.kv_cache, self.block_axis, pairs)

    def execute(
        self,
        plan: StepPlan,
        on_layer: Callable[[int], None] | None = None,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """The plan's forward pass on this rank's shard (KV written into this rank's
        cache), then the float32 logits of its rows, ``LOGITS_ROWS`` at a time (a long
        prompt's logprobs would otherwise hold prompt x vocabulary floats):
        ``on_logits(i, logits)`` with logits [r, vocab] of ``plan.rows[i : i + r]``.
        Every rank computes them (the LM head's gather is a collective)."""
        hidden = self.model(plan.input_ids, plan.positions, self.kv_caches, plan.meta, on_layer)
        for i in range(0, len(plan.rows), LOGITS_ROWS):
            logits = self.model.logits(hidden[plan.rows[i : i + LOGITS_ROWS]])
            if on_logits is not None:
                on_logits(i, logits)
