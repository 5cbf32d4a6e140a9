"""Shared by the KV transfer tests and their peer process: a reference cache that both
processes rebuild from a seed (KV heads, or latent rows), its per-rank shards, and the
peer process handle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.kv_transfer import KVLayout

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"pdserve-tests-kv-plane-secret-0001"  # the KV plane's secret in these tests
# the kv_transfer section a worker built in the test process takes (grpc, on loopback)
WORKER_KV = {
    "backend": "grpc",
    "checksum": True,
    "layerwise": True,
    "lease_s": 30.0,
    "secret": SECRET,
    "bind": "127.0.0.1",
    "advertise": "127.0.0.1",
}
H, D, BS = 4, 8, 4  # 4 KV heads (the acceptance's tiny model), head dim 8, blocks of 4


def layout(tp: int = 1, rank: int = 0, layers: int = 3, dtype: str = "float32",
           latent: dict | None = None) -> KVLayout:  # fmt: skip
    """A KV layout, or with ``latent`` (``heads``, ``dim``, ``rope``, ``replicated``) a
    latent one of ``heads`` latent heads of width ``dim`` and a RoPE key of ``rope``."""
    if latent is None:
        return KVLayout(layers, BS, H, D, dtype, tp, rank)
    return KVLayout(layers, BS, latent["heads"], latent["dim"], dtype, tp, rank, "latent",
                    latent["rope"], latent["replicated"])  # fmt: skip


def tokened(dst, tid: str):
    """``dst`` naming transfer ``tid`` on the wire: these tests use the id as its token
    (``KVReceiver.expect(..., token=tid)``); a cluster's are random."""
    import dataclasses

    return dataclasses.replace(dst, token=tid)


def reference(lay: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    """The full (all heads) cache a 1-rank prefill would compute: random, from ``seed``
    (latent: the model-wide rows ``[layers, blocks, block_size, Hc*Dc + Dr]``)."""
    g = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    if lay.kind == "latent":
        shape = (lay.num_layers, num_blocks, lay.block_size, lay.units)
    return torch.randn(shape, generator=g).to(lay.torch_dtype)


def shard(full: torch.Tensor, lay: KVLayout) -> torch.Tensor:
    """Rank ``lay.tp_rank``'s own cache tensor: its heads of ``full``, contiguous (latent:
    its latent heads' columns, then the RoPE columns)."""
    h0, h1 = lay.head_range
    if lay.kind == "latent":
        latent = lay.num_kv_heads * lay.head_dim
        mine = full[..., h0 * lay.head_dim : h1 * lay.head_dim]
        return torch.cat([mine, full[..., latent:]], dim=-1).contiguous()
    return full[..., h0:h1, :].contiguous()


class Peer:
    """A second process (``python -m tests.kv_transfer.peer``) driven by JSON lines."""

    def __init__(self, **env_vars):
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **env_vars)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_transfer.peer"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("peer process failed to start")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited (code {self.proc.poll()}) on {cmd['op']}")
        return json.loads(line)

    def gloo_send(self, key: str, tp: int, tid: str, dst, src_ids, seed: int,
                  num_blocks: int, senders: dict, **send) -> dict:  # fmt: skip
        """The peer's gloo senders ``key`` (``tp`` ranks, 3 layers, checksums; ``senders``:
        the rest of their options) send transfer ``tid``'s blocks ``src_ids`` of a
        reference cache (``seed``, ``num_blocks``) to ``dst`` (``send``: the rest of the
        send's options); the reply, with every rank's ack OK."""
        reply = self.ask(op="senders", key=key, backend="gloo", tp=tp, checksum=True,
                         layers=3, **senders)  # fmt: skip
        assert reply["ok"], reply
        reply = self.ask(op="send", key=key, tid=tid, seed=seed, num_blocks=num_blocks,
                         src_ids=list(src_ids), dst=dst.to_bytes().hex(), **send)  # fmt: skip
        assert reply["ok"], reply
        assert all(status == "OK" for acks in reply["acks"] for status in acks), reply
        return reply

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.kill()
