"""A discrete-event simulation of a pdserve cluster, co-located, disaggregated or hybrid,
on a cost model's step times (``planner.roofline``, ``planner.profile``).

What it models, as the engine and router do it:
- the router's FIFO queue: a request goes out when an instance has room (fewer than
  ``max_batch_size`` outstanding and the KV blocks it needs), least loaded first;
  disaggregated, the decode instance reserves first, then the prefill instance with the
  fewest queued prompt tokens gets the prompt; hybrid, the router's prefill choice
  (``planner.sim_hybrid``) sends it there or keeps it on the decode instance,
  which then runs it as a co-located one does; without a prefill pool, the remote
  side is the other decode instance with the fewest queued prompt tokens, whose mixed
  steps carry the prompt beside its own decodes;
- chunked prefill under the token budget, FCFS, several prompts per step;
- continuous decode batching (one token per running request per step);
- co-located mixed steps: decodes first, then prompt chunks, one step costing the cost
  model's ``mixed_s`` (its own fit of served mixed steps, or prefill + decode);
- the KV transfer past the prefill: layer-wise, only what the last chunk's step does
  not hide, max(0, transfer - step); else all of it;
- prefix hits, for requests given with their tokens (``planner.prefix``): each
  instance's LRU of block keys; a prompt computes only its uncached suffix, the
  transfer carries only the blocks the decode instance lacks; the router's policy
  (``least_loaded`` or ``cache_aware``) picks the instances; a conversation's next
  turn arrives its think time after the previous one finishes (closed loop).
Simplifications: a request reserves the blocks of its whole output at admission (no
preemption); the first token is streamed when the request reaches its decode batch.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass

from pdserve.engine.scheduler import prompt_budget
from pdserve.loadgen.metrics import Record
from pdserve.planner.cluster_spec import ClusterSpec, PoolSpec
from pdserve.planner.prefix import (
    NO_KEYS,
    Keys,
    PrefixLRU,
    SimInput,
    expected_hit,
    pick,
    take_hit,
)
from pdserve.planner.sim_hybrid import prefill_choice
from pdserve.router.prefill_choice import LOCAL


@dataclass
class SimRequest:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    blocks: int = 0
    dispatched_s: float = math.nan
    prefill_end_s: float = math.nan
    exposed_transfer_s: float = 0.0
    first_token_s: float = math.nan
    finish_s: float = math.nan
    instances: tuple[str, ...] = ()
    done: int = 0  # prompt tokens computed
    join_step: int = 0
    decode_instance: object = None  # disaggregated: where its blocks are reserved
    keys: Keys = NO_KEYS  # its block keys (none: no prefix hits)
    cached: int = 0  # prompt tokens served from the cache where it was prefilled
    transfer_tokens: int = 0  # disaggregated: prompt tokens the decode instance lacked
    next: tuple[tuple[float, SimRequest], ...] = ()  # (think time, next turn)

    def record(self, cost) -> Record:
        ttft = (self.first_token_s - self.arrival_s) * 1000
        n = self.output_len
        tpot = (self.finish_s - self.first_token_s) * 1000 / (n - 1) if n > 1 else 0.0
        disagg = len(self.instances) == 2
        kv_bytes = (
            cost.transfer_bytes(self.transfer_tokens, self.decode_instance.pool.tp) if disagg else 0
        )
        return Record(
            index=self.index,
            sent_s=self.arrival_s,
            prompt_tokens=self.prompt_len,
            output_len=n,
            completion_tokens=n,
            ttft_ms=ttft,
            tpot_ms=tpot,
            e2e_ms=(self.finish_s - self.arrival_s) * 1000,
            queue_ms=(self.dispatched_s - self.arrival_s) * 1000,
            finish_reason="length",
            instances=list(self.instances),
            kv_bytes=int(kv_bytes),
            cached_tokens=self.cached,
            transfer_ms=self.exposed_transfer_s * 1000,
            phases={"prefill_end": (self.prefill_end_s - self.arrival_s) * 1000},
        )


class DecodeBatch:
    """Running decodes: a step counter, finish steps in a heap, the context summed."""

    def __init__(self):
        self.k = 0
        self.heap: list[tuple[int, int, SimRequest]] = []
        self.context = 0

    def __len__(self) -> int:
        return len(self.heap)

    def join(self, r: SimRequest) -> bool:
        """False when the first token already finished the request."""
        if r.output_len <= 1:
            return False
        r.join_step = self.k
        heapq.heappush(self.heap, (self.k + r.output_len - 1, r.index, r))
        self.context += r.prompt_len + 1
        return True

    def steps_to_next_finish(self) -> int:
        return self.heap[0][0] - self.k

    def advance(self, steps: int = 1) -> list[SimRequest]:
        """``steps`` steps done: every running request has that many more tokens; the
        finished leave (``steps`` never passes the next finish)."""
        self.context += len(self.heap) * steps
        self.k += steps
        out = []
        while self.heap and self.heap[0][0] <= self.k:
            _, _, r = heapq.heappop(self.heap)
            self.context -= r.prompt_len + 1 + self.k - r.join_step
            out.append(r)
        return out


class Instance:
    def __init__(self, sim: Simulator, name: str, pool: PoolSpec, blocks: int):
        self.sim, self.name, self.pool = sim, name, pool
        self.role = name.rsplit("-", 1)[0]
        self.free_blocks, self.total_blocks = blocks, blocks
        self.cache = PrefixLRU(blocks) if pool.prefix_caching else None
        self.outstanding = 0
        self.busy = False
        self.queued_tokens = 0
        self.prompts: deque[SimRequest] = deque()  # admitted, prompt not done
        self.waiting: deque[SimRequest] = deque()  # co-located: sent, not admitted
        self.batch = DecodeBatch()
        self.joining: list[SimRequest] = []  # disaggregated decode: landed, next step
        # mixed steps (prompt chunks beside decodes): co-located, and hybrid decode
        self.mixed = self.role == "colocated" or (
            self.role == "decode" and sim.cluster.mode == "hybrid"
        )

    def has_room(self, r: SimRequest) -> bool:
        return self.outstanding < self.pool.max_batch_size and self.free_blocks >= r.blocks

    def kick(self) -> None:
        if not self.busy:
            self.sim.at(self.sim.now, self.step)

    def finish(self, r: SimRequest, t: float) -> None:
        r.finish_s = t
        self.free_blocks += r.blocks
        self.outstanding -= 1
        self.sim.done.append(r)
        if self.cache is not None:
            self.cache.insert(r.keys.whole)
        for think, turn in r.next:  # a conversation's next turn: closed loop
            turn.arrival_s = t + think
            self.sim.at(turn.arrival_s, lambda turn=turn: self.sim.arrive(turn))
        self.sim.dispatch()

    def chunks(self, budget: int, admit: bool) -> tuple[list[tuple[SimRequest, int]], float]:
        """Prompt chunks of one step, FCFS: (request, tokens) and the attention pairs x 2."""
        items, sq = [], 0.0
        for r in self.prompts:
            if budget <= 0:
                break
            n = min(r.prompt_len - r.done, budget)
            items.append((r, n))
            sq += (r.done + n) ** 2 - r.done**2
            budget -= n
        while admit and self.waiting and budget > 0:
            if len(self.prompts) + len(self.batch) >= self.pool.max_batch_size:
                break
            r = self.waiting.popleft()
            self.prompts.append(r)
            n = min(r.prompt_len - r.done, budget)  # done: its cache hit
            items.append((r, n))
            sq += (r.done + n) ** 2 - r.done**2
            budget -= n
        return items, sq

    def step(self) -> None:
        sim, now, tp = self.sim, self.sim.now, self.pool.tp
        if self.busy:
            return
        for r in self.joining:
            if not self.batch.join(r):
                self.finish(r, now)
        self.joining = []
        decodes = len(self.batch)
        budget = prompt_budget(self.pool.max_batch_tokens, decodes, self.pool.mixed_prefill_tokens)
        items, sq = self.chunks(budget, admit=self.mixed)
        tokens = sum(n for _, n in items)
        if not decodes and not tokens:
            return
        prefill = sim.cost.prefill_s(tokens, sq, tp) if tokens else 0.0
        if self.mixed:
            duration = sim.cost.mixed_s(tokens, sq, decodes, self.batch.context, tp)
        else:
            duration = prefill + sim.cost.decode_s(decodes, self.batch.context, tp)
        # free decode steps (a cost model that leaves decode out): run them all at once
        steps = self.batch.steps_to_next_finish() if duration == 0 and not items else 1
        self.busy = True
        sim.at(now + duration, lambda: self.end_step(items, decodes, prefill, steps))

    def end_step(self, items, decodes: int, prefill_s: float, steps: int) -> None:
        sim, now = self.sim, self.sim.now
        self.busy = False
        finished = self.batch.advance(steps) if decodes else []
        for r, n in items:
            r.done += n
            self.queued_tokens -= n
            if r.done == r.prompt_len:
                self.prompts.remove(r)
                r.prefill_end_s = now
                if self.cache is not None:
                    self.cache.insert(r.keys.prompt)
                sim.prefilled(self, r, prefill_s)
        for r in finished:
            self.finish(r, now)
        self.step()


class Simulator:
    def __init__(self, cluster: ClusterSpec, cost):
        self.cluster, self.cost = cluster, cost
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        self.queue: deque[SimRequest] = deque()
        self.done: list[SimRequest] = []
        if cluster.mode == "colocated":
            self.front = self._pool("colocated", cluster.colocated)
            self.prefill = []
        else:
            self.prefill = self._pool("prefill", cluster.prefill)
            self.front = self._pool("decode", cluster.decode)
        # hybrid without a prefill pool: the decode instances prefill for each other
        self.peers = cluster.mode == "hybrid" and not self.prefill

    def _pool(self, role: str, pool: PoolSpec) -> list[Instance]:
        blocks = pool.kv_blocks
        if blocks is None:
            blocks = self.cost.kv_capacity_tokens(pool.tp) // pool.block_size
        return [Instance(self, f"{role}-{i}", pool, blocks) for i in range(pool.instances)]

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self, requests: list[tuple[float, int, int] | SimInput]) -> list[Record]:
        """(arrival_s, prompt_len, output_len), or ``SimInput``s (with their tokens:
        prefix hits), in arrival order -> one Record each."""
        block = self.front[0].pool.block_size
        sims = []
        for i, item in enumerate(requests):
            if isinstance(item, SimInput):
                t, p, o = item.arrival_s, len(item.prompt_ids), len(item.output_ids)
            else:
                t, p, o = item
            r = SimRequest(i, t, p, o, blocks=math.ceil((p + o) / block))
            sims.append(r)
            if isinstance(item, SimInput):
                r.keys = Keys.of(item, block)
                if item.follows is not None:
                    sims[item.follows].next += ((item.think_s, r),)
                    continue
            self.at(t, lambda r=r: self.arrive(r))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        finished = {r.index for r in self.done}
        return [r.record(self.cost) if r.index in finished else self.lost(r) for r in sims]

    def lost(self, r: SimRequest) -> Record:
        """The record of a request that never ran."""
        big = r.blocks > self.front[0].total_blocks
        why = "does not fit the KV cache" if big else "an earlier turn of its conversation failed"
        return Record(r.index, r.arrival_s, r.prompt_len, r.output_len, error=why)

    def arrive(self, r: SimRequest) -> None:
        if r.blocks > self.front[0].total_blocks:
            return
        self.queue.append(r)
        self.dispatch()

    def dispatch(self) -> None:
        while self.queue:
            r = self.queue[0]
            room = [i for i in self.front if i.has_room(r)]
            if not room:
                return  # head-of-line: the next finish or landing tries again
            policy = self.cluster.policy
            inst = pick(room, r, policy, lambda i: (i.outstanding, -i.free_blocks))
            self.queue.popleft()
            r.dispatched_s = self.now
            hit = take_hit(inst, r) * inst.pool.block_size
            if self.cluster.mode == "colocated":
                self._start(inst, r, hit)
                continue
            candidates = [i for i in self.front if i is not inst] if self.peers else self.prefill
            pre = pick(candidates, r, policy, lambda i: i.queued_tokens) if candidates else None
            if self.cluster.mode == "hybrid":  # the router's choice, the same function
                remote_hit = expected_hit(pre, r) * pre.pool.block_size if pre else 0
                if prefill_choice(self, r, inst, pre, hit, remote_hit).where == LOCAL:
                    self._start(inst, r, hit)
                    inst.queued_tokens += r.prompt_len - hit
                    continue
            inst.outstanding += 1
            inst.free_blocks -= r.blocks
            r.transfer_tokens = r.prompt_len - hit  # the decode instance holds the hit
            r.cached = r.done = take_hit(pre, r) * pre.pool.block_size
            r.instances = (pre.name, inst.name)
            r.decode_instance = inst
            pre.prompts.append(r)
            pre.queued_tokens += r.prompt_len - r.cached
            pre.kick()

    def _start(self, inst: Instance, r: SimRequest, hit: int) -> None:
        """The whole request on ``inst``: prefill in its mixed steps (``hit`` prompt tokens
        served from its cache), then decode there."""
        r.cached = r.done = hit
        inst.outstanding += 1
        inst.free_blocks -= r.blocks
        r.instances = (inst.name,)
        inst.waiting.append(r)
        inst.kick()

    def prefilled(self, inst: Instance, r: SimRequest, step_s: float) -> None:
        """A prompt's last chunk is done: co-located (or prefilled locally in hybrid
        mode), it decodes there from now; else its KV lands on the reserved decode
        instance."""
        if r.decode_instance is None:
            r.first_token_s = self.now
            if not inst.batch.join(r):
                inst.finish(r, self.now)
            return
        exposed = self.cluster.exposed_transfer_s
        dec = r.decode_instance
        if exposed is None:
            nbytes = self.cost.transfer_bytes(r.transfer_tokens, dec.pool.tp)
            transfer = self.cost.transfer_s(nbytes)
            exposed = max(0.0, transfer - step_s) if self.cluster.layerwise else transfer
        r.exposed_transfer_s = exposed

        def land():
            r.first_token_s = self.now
            dec.joining.append(r)
            dec.kick()

        self.at(self.now + exposed, land)


def simulate(cluster: ClusterSpec, cost, requests: list[tuple[float, int, int]]) -> list[Record]:
    return Simulator(cluster, cost).run(requests)
