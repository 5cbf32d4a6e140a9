"""One forward pass as plain tensors: what rank 0 broadcasts to the other ranks of a
tensor-parallel engine each step.

Two broadcasts per step, no pickle: a fixed int64 header, then one int64 payload of
the concatenated inputs (and a third, of bytes, when the step carries ``extra``: what
the serving worker wants its other ranks to do around the pass, e.g. the KV sends of
the requests whose prompt completes, as protobuf). Every rank then runs the same
forward pass on its shard and computes logits for the same rows (the LM head's gather
is a collective).

    header  [command, T tokens, B sequences, W block-table width, R sample rows,
             num_decodes, max_query_len, max_seq_len, E extra bytes]
    payload input_ids[T] positions[T] query_start_loc[B+1] seq_lens[B]
            block_tables[B*W] slot_mapping[T] rows[R]
    extra   uint8[E]

Between two steps rank 0 may also copy blocks of its cache into the same blocks of every
other rank (``copy_blocks``: a replicated MLA latent that landed on decode rank 0 alone,
docs/kv_transfer.md "Latent caches"), on the same channel, so ordered with the steps:

    header  [COPY, N block ids, 0, ...]
    ids     int64[N] (block ids are the same on every rank: rank 0's block manager's)
    rows    the cache's blocks ``ids`` (along its block axis), in the cache's dtype

And each rank may copy blocks of its own cache into others (``fork_blocks``: the last,
partial block of a prompt for each choice forked from it, engine/choices.py):

    header  [FORK, N pairs, 0, ...]
    ids     int64[2N]: the source blocks, then the destination blocks

A rank writes the rows before it receives the next header: they are in place before any
step that reads them. A collective that fails leaves the ranks out of step (the serving
worker ends the instance, instance/worker.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionMetadata
from pdserve.engine.parallel import TensorParallel

HEADER = 9


class Command(enum.IntEnum):
    STEP = 1
    STOP = 2
    COPY = 3
    FORK = 4


@dataclass
class StepPlan:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    rows: list[int]  # hidden-state rows whose next token is sampled
    extra: bytes = b""

    def broadcast(self, tp: TensorParallel) -> None:
        """Rank 0: send this plan to the other ranks."""
        m = self.meta
        b, w = m.block_tables.shape
        header = [Command.STEP, len(self.input_ids), b, w, len(self.rows)]
        header += [m.num_decodes, m.max_query_len, m.max_seq_len, len(self.extra)]
        tp.broadcast(torch.tensor(header, dtype=torch.int64, device=tp.device))
        parts = [
            self.input_ids,
            self.positions,
            m.query_start_loc,
            m.seq_lens,
            m.block_tables.flatten(),
            m.slot_mapping,
            torch.tensor(self.rows, dtype=torch.int64),
        ]
        tp.broadcast(torch.cat([p.to(tp.device, torch.int64) for p in parts]))
        if self.extra:
            extra = torch.frombuffer(bytearray(self.extra), dtype=torch.uint8)
            tp.broadcast(extra.to(tp.device))

    @staticmethod
    def stop(tp: TensorParallel) -> None:
        """Rank 0: tell the other ranks to leave their loop."""
        stop = [Command.STOP] + [0] * (HEADER - 1)
        tp.broadcast(torch.tensor(stop, dtype=torch.int64, device=tp.device))

    @staticmethod
    def copy_blocks(tp: TensorParallel, cache: torch.Tensor, axis: int, ids: list[int]) -> None:
        """Rank 0: the blocks ``ids`` of ``cache`` (blocks along dim ``axis``) into the
        same blocks of every other rank's cache (``receive`` writes them)."""
        if tp.size == 1 or not ids:
            return
        header = [Command.COPY, len(ids)] + [0] * (HEADER - 2)
        tp.broadcast(torch.tensor(header, dtype=torch.int64, device=tp.device))
        index = tp.broadcast(torch.tensor(ids, dtype=torch.int64, device=tp.device))
        tp.broadcast(cache.index_select(axis, index.to(cache.device)).to(tp.device))

    @staticmethod
    def fork_blocks(
        tp: TensorParallel, cache: torch.Tensor, axis: int, pairs: list[tuple[int, int]]
    ) -> None:
        """Rank 0: copy, in every rank's own cache (this one's included), block ``src``
        into block ``dst`` for each pair (blocks along dim ``axis``)."""
        if not pairs:
            return
        if tp.size > 1:
            header = [Command.FORK, len(pairs)] + [0] * (HEADER - 2)
            tp.broadcast(torch.tensor(header, dtype=torch.int64, device=tp.device))
            ids = [s for s, _ in pairs] + [d for _, d in pairs]
            tp.broadcast(torch.tensor(ids, dtype=torch.int64, device=tp.device))
        _copy_within(cache, axis, pairs)

    @staticmethod
    def _receive_fork(tp: TensorParallel, cache: torch.Tensor, axis: int, n: int) -> None:
        ids = tp.broadcast(torch.empty(2 * n, dtype=torch.int64, device=tp.device)).tolist()
        _copy_within(cache, axis, list(zip(ids[:n], ids[n:], strict=True)))

    @staticmethod
    def _receive_copy(tp: TensorParallel, cache: torch.Tensor, axis: int, n: int) -> None:
        index = tp.broadcast(torch.empty(n, dtype=torch.int64, device=tp.device))
        shape = list(cache.shape)
        shape[axis] = n
        rows = tp.broadcast(torch.empty(shape, dtype=cache.dtype, device=tp.device))
        cache.index_copy_(axis, index.to(cache.device), rows.to(cache.device))

    @classmethod
    def receive(
        cls, tp: TensorParallel, device: torch.device, cache: torch.Tensor, axis: int
    ) -> StepPlan | None:
        """Ranks > 0: the next plan, or None when rank 0 stops; the copies rank 0 sends
        before it (``copy_blocks``) are written into ``cache`` (blocks along ``axis``)."""
        while True:
            header = tp.broadcast(torch.empty(HEADER, dtype=torch.int64, device=tp.device))
            command, t, b, w, r, num_decodes, max_query_len, max_seq_len, e = header.tolist()
            if command == Command.COPY:
                cls._receive_copy(tp, cache, axis, t)
            elif command == Command.FORK:
                cls._receive_fork(tp, cache, axis, t)
            else:
                break
        if command == Command.STOP:
            return None
        n = 3 * t + 2 * b + 1 + b * w + r
        payload = tp.broadcast(torch.empty(n, dtype=torch.int64, device=tp.device)).cpu()
        sizes = [t, t, b + 1, b, b * w, t, r]
        ids, pos, qsl, lens, tables, slots, rows = payload.split(sizes)
        qsl_host, lens_host = qsl.tolist(), lens.tolist()
        extra = b""
        if e:
            extra = tp.broadcast(torch.empty(e, dtype=torch.uint8, device=tp.device))
            extra = extra.cpu().numpy().tobytes()

        def dev(x, dtype):
            return x.to(device=device, dtype=dtype)

        meta = AttentionMetadata(
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(lens, torch.int32),
            block_tables=dev(tables.view(b, w), torch.int32),
            slot_mapping=dev(slots, torch.int64),
            num_decodes=num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_lens_host=[qsl_host[i + 1] - qsl_host[i] for i in range(b)],
            seq_lens_host=lens_host,
        )
        return cls(dev(ids, torch.int64), dev(pos, torch.int64), meta, rows.tolist(), extra)


def _copy_within(cache: torch.Tensor, axis: int, pairs: list[tuple[int, int]]) -> None:
    src = torch.tensor([s for s, _ in pairs], device=cache.device)
    dst = torch.tensor([d for _, d in pairs], device=cache.device)
    cache.index_copy_(axis, dst, cache.index_select(axis, src))
