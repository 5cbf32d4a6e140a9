"""Two-rank process groups for the gloo and nccl backends, and what both ends of a pair
share to form one: the receiver's store keys and its address format."""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import asdict

import torch

from kv_transfer.errors import KVPeerError
from kv_transfer.layout import KVLayout

JOIN_QUEUE = "kv/joins"  # join requests, JSON: {name, rank, gen, host, layout}
INFO_KEY = "kv/receiver"  # the receiver, JSON: {layout, backend, incarnation, pack_bytes}
POLL_S = 0.02  # how often the receiver's accept thread looks for joins (and close())
FOREVER = datetime.timedelta(days=365)  # an idle pair waits for its next header this long


class GlooGroup:
    """Builds two-rank gloo groups; ``NcclGroup`` swaps the group type and the device."""

    device_type = "cpu"
    tagged = True  # messages match per tag (NCCL: in order, tags ignored)

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return ProcessGroupGloo(store, rank, 2, opts)

    @staticmethod
    def sync() -> None:
        return None

    @staticmethod
    def settle(tensor: torch.Tensor) -> None:
        """After a send was waited for: make its buffer safe to write again."""
        return None


class NcclGroup(GlooGroup):
    device_type = "cuda"
    tagged = False

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        if not torch.cuda.is_available():
            raise KVPeerError("the nccl KV backend needs CUDA; use gloo or grpc on CPU")
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = FOREVER  # an idle receiver keeps a header recv posted
        return ProcessGroupNCCL(store, rank, 2, opts)

    @staticmethod
    def sync() -> None:
        torch.cuda.current_stream().synchronize()

    @staticmethod
    def settle(tensor: torch.Tensor) -> None:
        torch.cuda.current_stream(tensor.device).synchronize()


def abort(pg) -> None:
    if pg is None:
        return
    with contextlib.suppress(Exception):  # already gone
        pg.abort()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV receiver address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def layout_json(layout: KVLayout) -> dict:
    return asdict(layout)
