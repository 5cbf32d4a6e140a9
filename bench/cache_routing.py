"""What ``router.policy: cache_aware`` adds on the router's event loop (``least_loaded``
and ``round_robin`` hash nothing): hashing a prompt and scoring every candidate per
request; per poll, applying an instance's cache delta; and the deltas' sizes on the
update feed.

    .venv/bin/python -m pdserve.bench.cache_routing

Each time is the best of 5 ``timeit`` repeats, in microseconds.
"""

from __future__ import annotations

import random
import timeit

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.block_manager import CacheEvents
from pdserve.instance.feed import encode
from pdserve.instance.logs import CacheLog
from pdserve.instance.messages import CacheCursor, Polled
from pdserve.router.cache_index import CacheIndex
from pdserve.router.policies import CacheAware, InstanceLoad


def best(f, n: int) -> float:
    """Microseconds of one call of ``f``, best of 5 repeats of ``n``."""
    return min(timeit.repeat(f, number=n, repeat=5)) / n * 1e6


def main() -> None:
    rng = random.Random(0)
    for n in (512, 4096):
        prompt = [rng.randrange(32000) for _ in range(n)]
        hashes = block_hashes(prompt, 16)
        index = CacheIndex()
        index.hashes.update(hashes[: len(hashes) // 2], range(2048))
        loads = [InstanceLoad(f"i{i}", i, total_blocks=2048, free_blocks=1024) for i in range(8)]

        def score(loads=loads, index=index, hashes=hashes, n=n) -> None:
            for c in loads:
                c.hit_tokens = index.hit_blocks(hashes) * 16
            CacheAware().choose(n, loads)

        hashing = best(lambda prompt=prompt: block_hashes(prompt, 16), 20)
        print(
            f"{n}-token prompt: hash {hashing:.0f} us, score 8 candidates {best(score, 50):.0f} us"
        )
    log = CacheLog(retain=2048)
    log.record(CacheEvents(stored=[rng.getrandbits(64) for _ in range(2048)]))
    snapshot = log.since(CacheCursor())
    log.record(CacheEvents(stored=[rng.getrandbits(64) for _ in range(8)]))
    apply = best(lambda: CacheIndex().apply(snapshot), 20)
    print(f"snapshot of 2048 hashes: {wire(snapshot)} B on the feed, applied in {apply:.0f} us")
    print(f"one step's delta (8 hashes): {wire(log.since(snapshot.cursor))} B on the feed")


def wire(delta) -> int:
    """Bytes of a feed frame that carries only ``delta`` (instance/feed.py's encoding)."""
    return len(encode(Polled([], {}, delta)))


if __name__ == "__main__":
    main()
