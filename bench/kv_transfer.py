"""KV transfer throughput: each backend next to its raw transport, in one run.

    .venv/bin/python -m pdserve.bench.kv_transfer [--sizes 1,16,256] [--checksum]
                                          [--blocks scattered|contiguous|allocated]
                                          [--repeats N]
                                          [--layerwise]

Two processes on loopback: this one sends, a child process receives. For each size of
KV (the embedded model's layout: 30 layers, 3 KV heads x 64, blocks of 16 tokens,
float32, so 720 KiB per block), it times, end to end at the sender (first byte handed
over -> receiver's acknowledgement that everything landed):

* ``copy``: a same-process tensor copy of the same bytes (the memory floor);
* ``raw gloo``: one tensor, plain ``ProcessGroupGloo`` send/recv into a ready tensor;
* ``raw gloo, 60 msgs``: the same bytes as 60 messages (K and V of every layer);
* ``gloo``: ``kv_transfer`` gloo backend, paged cache to paged cache (``send_all``);
* ``raw grpc``: the same bytes over one gRPC stream in chunks of the same size as the
  backend's, copied into a ready tensor at the receiver;
* ``grpc``: ``kv_transfer`` grpc backend, paged cache to paged cache.

The cells of one size are timed round by round (each cell once per round, medians over
``--repeats`` rounds), so that the machine's slow drifts hit every cell alike. GB/s are
payload bytes per second (1e9); the ratio is backend / raw transport. Source and
destination block ids are a random scatter of a larger cache by default, the worst
case; ``--blocks contiguous`` sends one run of consecutive ids on each side, which the
backends send without gathering first; ``--blocks allocated`` takes the ids the
engine's block manager hands out after churn (``engine/block_manager.py`` keeps tables
in runs), as serving does. The "runs" column counts the runs of consecutive ids of the
source and the destination. Do not run it beside the tests: the machine has 2 cores.

``--layerwise`` then measures, on the embedded model through real clusters, how much
of the transfer layer-wise sending hides from TTFT (``bench/layerwise.py``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from pdserve.bench.kv_transfer_peer import CHUNK, LAYOUT, MiB, Peer, _layout, _slices


def _blocks_for(size_mib: int) -> int:
    per_block = 2 * LAYOUT["num_layers"] * _layout().block_bytes()
    return max(1, -(-size_mib * MiB // per_block))


def _interleaved(cells: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each cell (a function timing one transfer), measured round by
    round (every cell once per round, after one warm-up each), so that the machine's
    slow drifts hit every cell alike."""
    times: dict[str, list[float]] = {name: [] for name in cells}
    for fn in cells.values():
        fn()  # warm-up: pairs and channels formed, buffers touched
    for _ in range(rounds):
        for name, fn in cells.items():
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def copy_cell(nbytes: int):
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: _timed(lambda: dst.copy_(src))


def raw_gloo_cell(peer: Peer, nbytes: int, state: dict, parts: int = 1):
    """Plain send/recv of ``nbytes`` as ``parts`` messages (the receiver posts all first)."""
    from torch.distributed import PrefixStore, TCPStore

    from pdserve.kv_transfer.gloo_wire import GlooGroup

    srcs = _slices(torch.ones(nbytes, dtype=torch.uint8), parts)
    ack = torch.zeros(1, dtype=torch.int64)

    def once() -> float:
        peer.ask(op="raw_gloo", nbytes=nbytes, parts=parts)
        if "raw_pg" not in state:
            store = TCPStore(
                "127.0.0.1", peer.addresses["raw_gloo"], None, False, datetime.timedelta(seconds=60)
            )
            state["raw_pg"] = GlooGroup.make_group(
                PrefixStore("raw", store), 0, "127.0.0.1", datetime.timedelta(seconds=60)
            )
        pg = state["raw_pg"]
        t = time.perf_counter()
        for work in [pg.send([s], 1, 0) for s in srcs]:
            work.wait()
        pg.recv([ack], 1, 1).wait()
        return time.perf_counter() - t

    return once


def raw_grpc_cell(peer: Peer, nbytes: int, state: dict):
    import grpc

    if "raw_call" not in state:
        channel = grpc.insecure_channel(peer.addresses["raw_grpc"])
        state["raw_call"] = channel.stream_unary("/bench.Raw/Push")
    call = state["raw_call"]
    view = torch.ones(nbytes, dtype=torch.uint8).numpy()

    def chunks():
        for off in range(0, nbytes, CHUNK):
            yield view[off : off + CHUNK].tobytes()

    def once():
        got = int.from_bytes(call(chunks()), "little")
        assert got == nbytes, (got, nbytes)

    return lambda: _timed(once)


def backend_cell(name: str, peer: Peer, sender, cache, src_ids, dst_ids):
    from pdserve.kv_transfer import KVDestination

    counter = iter(range(1 << 30))

    def once() -> float:
        tid = f"{name}-{next(counter)}"
        token = peer.ask(op="expect", backend=name, tid=tid, dst=list(dst_ids))["token"]
        dst = KVDestination([peer.addresses[name]], dst_ids, _layout(), name, token)
        t = time.perf_counter()
        sender.send_all(tid, cache, src_ids, dst)
        sender.finish(tid, timeout=120)
        elapsed = time.perf_counter() - t
        peer.ask(op="wait", backend=name, tid=tid)
        return elapsed

    return once


def _ids(count: int, cache_blocks: int, blocks: str, seed: int) -> list[int]:
    if blocks == "contiguous":
        start = (seed * 7) % (cache_blocks - count + 1)
        return list(range(start, start + count))
    if blocks == "allocated":
        return _allocated_ids(count, cache_blocks, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(cache_blocks, generator=g)[:count].tolist()


def _allocated_ids(count: int, cache_blocks: int, seed: int) -> list[int]:
    """The ids the engine's block manager gives a request of ``count`` blocks after churn:
    requests of 2-40 blocks arrive while more than ``1.25 x count`` blocks stay free, grow a
    block at a time (interleaved, as decodes do) and leave; then the request is
    allocated."""
    import random

    from pdserve.engine.block_manager import BlockManager

    rng = random.Random(seed)
    bm = BlockManager(cache_blocks, 1)
    running: list[str] = []
    for step in range(3000):
        size = rng.randint(2, 40)
        if rng.random() < 0.3 and bm.num_free_blocks - size > count * 5 // 4:
            running.append(f"r{step}")
            bm.allocate(running[-1], size)
        for rid in list(running):
            if rng.random() < 0.05:
                bm.free(rid)
                running.remove(rid)
            elif rng.random() < 0.5 and bm.num_free_blocks > count * 5 // 4:
                bm.allocate(rid, len(bm.block_table(rid)) + 1)
    return bm.allocate("transfer", count)


def _runs(ids: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,16,256", help="MiB of KV per transfer")
    p.add_argument(
        "--blocks",
        choices=("scattered", "contiguous", "allocated"),
        default="scattered",
        help="random ids, runs of consecutive ids, or the engine allocator's after churn",
    )
    p.add_argument("--checksum", action="store_true", help="backends checksum every chunk")
    p.add_argument("--repeats", type=int, default=0, help="timed runs per cell (0: by size)")
    p.add_argument("--layerwise", action="store_true", help="then TTFT with layer-wise sending")
    args = p.parse_args(argv)
    from pdserve.kv_transfer import get_transport

    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    blocks = {s: _blocks_for(s) for s in sizes}
    cache_blocks = max(blocks.values()) * 2
    layout = _layout()
    per_block = 2 * layout.num_layers * layout.block_bytes()
    max_bytes = max(blocks.values()) * per_block
    cache = torch.randn(layout.cache_shape(cache_blocks))
    from pdserve.kv_transfer.auth import new_secret

    secret = new_secret()
    peer = Peer(cache_blocks, max_bytes, secret)
    senders = {
        name: get_transport(name).sender(
            layout, secret=secret, bind="127.0.0.1", checksum=args.checksum
        )
        for name in ("gloo", "grpc")
    }
    state: dict = {}
    rows = []
    try:
        for size in sizes:
            n = blocks[size]
            nbytes = n * per_block
            reps = args.repeats or (20 if size <= 4 else 12 if size <= 64 else 5)
            src_ids = _ids(n, cache_blocks, args.blocks, seed=size)
            dst_ids = _ids(n, cache_blocks, args.blocks, seed=size + 1)
            parts = 2 * layout.num_layers  # K and V of every layer, one message each
            cells = {
                "copy": copy_cell(nbytes),
                "raw gloo": raw_gloo_cell(peer, nbytes, state),
                "raw gloo parts": raw_gloo_cell(peer, nbytes, state, parts),
                "gloo": backend_cell("gloo", peer, senders["gloo"], cache, src_ids, dst_ids),
                "raw grpc": raw_grpc_cell(peer, nbytes, state),
                "grpc": backend_cell("grpc", peer, senders["grpc"], cache, src_ids, dst_ids),
            }
            row = {"MiB": nbytes / MiB, "blocks": n, "runs": (_runs(src_ids), _runs(dst_ids))}
            row.update({k: nbytes / v for k, v in _interleaved(cells, reps).items()})
            rows.append(row)
            print(_table(rows[-1:], header=len(rows) == 1), flush=True)
    finally:
        for s in senders.values():
            s.close()
        peer.close()
    print()
    print(
        f"blocks: {args.blocks}; checksum: {'on' if args.checksum else 'off'}; "
        f"GB/s = payload bytes / s (1e9); ratio = backend / raw transport"
    )
    if args.layerwise:
        from pdserve.bench.layerwise import main as layerwise

        print("\nlayer-wise sending on the embedded model (bench/layerwise.py):", flush=True)
        layerwise([])


def _table(rows: list[dict], header: bool = True) -> str:
    cols = ["copy", "raw gloo", "raw gloo parts", "gloo", "raw grpc", "grpc"]
    lines = []
    if header:
        lines.append(
            "| KV MiB | blocks | runs src/dst | copy GB/s | raw gloo GB/s | raw gloo, 60 msgs GB/s "
            "| gloo GB/s | gloo/raw | raw grpc GB/s | grpc GB/s | grpc/raw |"
        )
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = {c: r[c] / 1e9 for c in cols}
        lines.append(
            f"| {r['MiB']:.1f} | {r['blocks']} | {r['runs'][0]}/{r['runs'][1]} "
            f"| {g['copy']:.2f} | {g['raw gloo']:.2f} "
            f"| {g['raw gloo parts']:.2f} | {g['gloo']:.2f} | {g['gloo'] / g['raw gloo']:.0%} "
            f"| {g['raw grpc']:.2f} | {g['grpc']:.2f} | {g['grpc'] / g['raw grpc']:.0%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
