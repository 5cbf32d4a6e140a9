"""The prefill instance: a Ray actor that prefills prompts and hands them to decode.

Per request (router/disagg.py places it, after the decode instance reserved blocks):

    prefill(...) -> chunked prefill, FCFS with other prompts under the token budget
                 -> last chunk: KV sent layer by layer during the forward pass
                    (kv_transfer.layerwise), or all layers after it
                 -> first token sampled; KVHandoff sent to the decode instance (admit)
                 -> transfer acknowledged by every decode rank: blocks freed here,
                    Update(handed_off) to the router; a failed transfer is an
                    Update(retryable) and the router redoes the request on another pair.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine import SamplingParams
from engine.updates import Update
from engine.worker import EngineWorker
from kv_transfer import KVDestination, KVHandoff, get_transport
from kv_transfer.endpoints import cache_layout, kv_host
from kv_transfer.proto import kv_transfer_pb2 as kv_pb
from prefill_worker.prefill_engine import Prefilled, PrefillEngine


def ack_timeout_s(lease_s: float) -> float:
    """How long a sender waits for the acknowledgement: past the decode lease, so that a
    transfer that never completes is reported by the decode instance, which owns the
    reservation (and releases it), not by whichever side's timer fires first."""
    return 1.5 * lease_s


@dataclass(eq=False)
class Job:
    """A request in this instance: where its KV goes and how its transfer stands."""

    request_id: str
    transfer_id: str
    destination: KVDestination
    decode: str  # the decode instance's name
    decode_handle: object  # ... and its actor handle, for the handoff
    transfer_start: float | None = None  # wall clock, first layer handed to the transport
    send_error: str | None = None
    aborted: bool = False  # the client left while the KV was on its way
    cut_after: int | None = None  # fault injection: layers from this one on are never sent

    def sends(self, layer: int) -> bool:
        return self.cut_after is None or layer < self.cut_after


class PrefillWorker(EngineWorker):
    engine_class = PrefillEngine
    role = "prefill"

    def _setup(self, kv_config: dict) -> None:
        self.layout = cache_layout(self.engine.model, self.engine.blocks)
        transport = get_transport(kv_config["backend"])
        options = {"checksum": kv_config["checksum"], "name": self.name}
        if transport.name != "grpc":
            options["host"] = kv_host()
        self.sender = transport.sender(self.layout, **options)
        self.layerwise = kv_config["layerwise"]
        self.ack_timeout_s = ack_timeout_s(kv_config["lease_s"])
        self.jobs: dict[str, Job] = {}
        self._acks = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{self.name}-acks")
        self._cuts_left, self._cut_after = 0, 0
        self._totals["kv_bytes_total"] = 0

    def ready(self) -> dict:
        return {**super().ready(), "kv_tp_size": self.layout.tp_size}

    def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: dict,
        transfer_id: str,
        destination: bytes,
        decode: str,
        decode_handle,
        consumer: str,
    ) -> None:
        """Prefill a prompt and send its KV to ``destination`` (a ``KVDestination`` as
        protobuf bytes: the blocks the decode instance ``decode`` reserved for it); the
        handoff goes to ``decode_handle``, that instance's actor."""
        job = (request_id, prompt_ids, params, transfer_id, destination, (decode, decode_handle))
        job += (consumer,)
        self._post(("prefill", *job))

    def debug_fault(self, kind: str, count: int = 1, after_layers: int = 0) -> None:
        """Testing aid: make the next ``count`` transfers fail. ``cut``: only their first
        ``after_layers`` layers are sent and the link stays silent, as if it went down
        (the decode lease runs out, and the wait for an acknowledgement); ``corrupt``: a
        bit flips in a segment after its checksum was taken (with
        ``kv_transfer.checksum`` on, the receiver refuses it)."""
        if kind == "corrupt":
            self.sender.debug_corrupt_next_segment(count)
        elif kind == "cut":
            self.on_loop(self._set_cuts, count, after_layers)
        else:
            raise ValueError(f"kind={kind!r}: allowed values are cut, corrupt")

    def _set_cuts(self, count: int, after_layers: int) -> None:
        self._cuts_left, self._cut_after = count, after_layers

    def stop(self) -> None:
        super().stop()
        self._acks.shutdown(wait=False, cancel_futures=True)
        self.sender.close()

    # ---- on the step loop ----

    def _op_prefill(
        self, request_id, prompt_ids, params, transfer_id, destination, decode, consumer
    ):
        if self._take_early_abort(request_id):
            return []
        self._consumer[request_id] = consumer
        dst = KVDestination.from_proto(kv_pb.KVDestination.FromString(destination))
        try:
            self.engine.add_request(request_id, prompt_ids, SamplingParams(**params))
        except ValueError as e:
            return [Update(request_id, error=str(e))]
        job = self.jobs[request_id] = Job(request_id, transfer_id, dst, *decode)
        if self._cuts_left:
            self._cuts_left -= 1
            job.cut_after = self._cut_after
        self._totals["requests_total"] += 1
        return []

    def _owns(self, request_id: str) -> bool:
        return request_id in self.jobs

    def _abort(self, request_id: str) -> list[Update]:
        if request_id in self.engine.requests:  # still prefilling: nothing was sent
            self.engine.abort_request(request_id)
            del self.jobs[request_id]
        else:  # its KV is on the way: the blocks go when the transfer ends
            self.jobs[request_id].aborted = True
        return []

    def _step(self) -> list[Update]:
        try:
            done = self.engine.step(self._plan_sends)
        except Exception:
            return self._fail_all()
        self._totals["steps_total"] += 1
        return [u for p in done for u in self._hand_off(p)]

    def _fail_all(self) -> list[Update]:
        failed = super()._fail_all()
        for u in failed:
            self.sender.abort(self.jobs.pop(u.request_id).transfer_id)
        return failed

    def _plan_sends(self, last):
        """For the requests in ``last`` (prompt complete in this step): the per-layer
        callback sending each finished layer (layer-wise), and the ``SendList`` that
        tells the other tensor-parallel ranks to send their heads."""
        jobs = [self.jobs[r.request_id] for r in last]
        tables = {j.request_id: self.engine.blocks.block_table(j.request_id) for j in jobs}
        caches = self.engine.runner.kv_caches

        def on_layer(layer: int) -> None:
            k_cache, v_cache = caches[layer]
            for job in jobs:
                if job.sends(layer):
                    self._send(job, lambda j=job: self.sender.send_layer(
                        j.transfer_id, layer, k_cache, v_cache, tables[j.request_id], j.destination
                    ))  # fmt: skip

        extra = b""
        if self.ranks:
            msg = kv_pb.SendList(layerwise=self.layerwise)
            for job in jobs:
                h = msg.sends.add(transfer_id=job.transfer_id)
                h.src_block_ids.extend(tables[job.request_id])
                job.destination.to_proto(h.destination)
            extra = msg.SerializeToString()
        return (on_layer if self.layerwise else None), extra

    def _send(self, job: Job, send) -> None:
        if job.send_error is not None:
            return
        job.transfer_start = job.transfer_start or time.time()
        try:
            send()
        except Exception as e:  # a broken pair, a layout mismatch: the request is retried
            job.send_error = f"{type(e).__name__}: {e}"

    def _hand_off(self, p: Prefilled) -> list[Update]:
        request_id = p.request.request_id
        job = self.jobs[request_id]
        if p.error is not None:
            del self.jobs[request_id]
            return [Update(request_id, error=p.error, retryable=True)]
        if not self.layerwise:
            c = self.engine.runner.kv_cache
            layers = [(i, c[i, 0], c[i, 1]) for i in range(len(c)) if job.sends(i)]
            self._send(job, lambda: self.sender.send_layers(
                job.transfer_id, layers, p.block_ids, job.destination
            ))  # fmt: skip
        if job.send_error is None:
            handoff = KVHandoff(
                request_id=request_id,
                prompt_token_ids=p.request.prompt_token_ids,
                first_token=p.first_token,
                src_block_ids=p.block_ids,
                src_layout=self.layout,
                destination=job.destination,
                transfer_id=job.transfer_id,
                prefill_instance=self.name,
                sampler_state=p.sampler_state,
                phase_times={**p.times, "transfer_start": job.transfer_start},
            )
            job.decode_handle.admit.remote(handoff.to_bytes())
        self._acks.submit(self._await_ack, job)
        return []

    def _await_ack(self, job: Job) -> None:
        """On an ack thread: wait for every decode rank's acknowledgement of the sends of
        every rank of this instance, then report to the loop."""
        ack, error = None, job.send_error
        if job.cut_after is not None:  # injected: the link is down, no answer ever comes
            self.sender.abort(job.transfer_id)
            time.sleep(self.ack_timeout_s)
            error = f"no acknowledgement within {self.ack_timeout_s:g}s (link cut, injected)"
        elif error is None:
            try:
                ack = self.sender.finish(job.transfer_id, timeout=self.ack_timeout_s)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        else:
            self.sender.abort(job.transfer_id)
        nbytes = ack.bytes if ack is not None else 0
        if self.ranks:
            import ray

            for rank_bytes, rank_error in ray.get(
                [r.acked.remote(job.transfer_id) for r in self.ranks]
            ):
                nbytes += rank_bytes
                error = error or rank_error or None
        seconds = ack.seconds if ack is not None else 0.0
        self._post(("acked", job, nbytes, seconds, error))

    def _op_acked(self, job: Job, nbytes: int, seconds: float, error: str | None):
        self.engine.release(job.request_id)
        self.jobs.pop(job.request_id, None)
        if job.aborted:
            return []
        if error is not None:
            why = f"KV transfer {job.transfer_id!r} {self.name} -> {job.decode} failed: {error}"
            return [Update(job.request_id, error=why, retryable=True)]
        self._totals["kv_bytes_total"] += nbytes
        info = {"kv_bytes": nbytes, "transfer_s": seconds}
        return [Update(job.request_id, handed_off=True, info=info)]

    def _stats(self) -> dict:
        stats = super()._stats()
        stats["in_transfer"] = len(self.jobs) - len(self.engine.requests)
        return stats
