"""Every listener of a loopback cluster is on loopback (docs/kv_transfer.md, "Closed by
default"). A disaggregated cluster with tensor-parallel instances (gloo: decode TP 2;
grpc: prefill TP 2) serves requests; then every listening socket of every process of
the cluster (the driver, the router, the supervisor, every rank of every instance) is
listed with psutil: all are on 127.0.0.0/8 or ::1 but one per process, Ray's own: its
core worker's gRPC server, which Ray 2.60 binds to ``::`` whatever
``_node_ip_address`` says (and advertises as the machine's address). That one is
excluded by its port, read from the process's own Ray core worker (the owner address of
an object it puts), and required to be there, so nothing else can hide behind it."""

from __future__ import annotations

import ipaddress

import psutil
import pytest
import ray

from tests.cluster.test_disagg import check_pools, disagg_config, run_concurrently, workload


def _processes(cluster) -> dict[int, tuple[str, int]]:
    """pid: (which process, the port of its Ray core worker's own server)."""

    def ray_port(_actor=None) -> tuple[int, int]:
        import os

        import ray
        from ray.core.generated.common_pb2 import Address

        core = ray._private.worker.global_worker.core_worker
        return os.getpid(), Address.FromString(core.get_owner_address(ray.put(0))).port

    actors = {"router": cluster.router, "supervisor": cluster.supervisor}
    for name in cluster.workers:
        h = cluster.handles(name)
        actors.update({f"{name} rank {r}": a for r, a in enumerate([h.worker, *h.ranks])})
    out = {}
    for who, actor in actors.items():
        pid, port = ray.get(actor.__ray_call__.remote(ray_port), timeout=30)
        out[pid] = (who, port)
    pid, port = ray_port()
    out[pid] = ("driver", port)
    return out


def _listening(pid: int) -> list[tuple[str, int]]:
    conns = psutil.Process(pid).net_connections(kind="inet")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.parametrize("backend,prefill_tp,decode_tp", [("gloo", 1, 2), ("grpc", 2, 1)])
def test_every_listener_is_on_loopback(chat_model, backend, prefill_tp, decode_tp):
    from cluster import launch

    config = disagg_config(chat_model, backend, True, 1)
    config["prefill"].update(tensor_parallel=prefill_tp, resources={"num_cpus": 0.5})
    config["decode"].update(tensor_parallel=decode_tp, resources={"num_cpus": 0.5})
    with launch(config) as cluster:
        streams = run_concurrently(cluster.client(), workload(4, seed=5))
        assert all(chunks[-1].finish_reason == "length" for chunks in streams)
        procs = _processes(cluster)
        assert len(procs) == 3 + prefill_tp + decode_tp  # driver, router, supervisor, ranks
        wide, ours = {}, {}
        for pid, (who, ray_port) in procs.items():
            sockets = _listening(pid)
            assert ray_port in [port for _, port in sockets], (who, ray_port, sockets)
            ours[who] = [a for a in sockets if a[1] != ray_port]
            wide[who] = [a for a in ours[who] if not _loopback(a[0])]
        assert not any(wide.values()), wide
        # the sockets checked are there: the decode ranks' KV receivers, the TP stores
        tp_rank0 = "decode-0 rank 0" if decode_tp > 1 else "prefill-0 rank 0"
        assert ours["decode-0 rank 0"] and ours[tp_rank0] and ours["router"], ours
        check_pools(cluster)
