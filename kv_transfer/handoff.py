"""What a prefill instance hands a decode instance (DistServe style), and where KV goes.

Both are frozen dataclasses that travel as protobuf bytes (``to_bytes``/``from_bytes``),
never pickled. The handoff carries the source layout (tensor-parallel degree; each
rank's head range follows from it) so the decode side can compute which prefill ranks
send it which heads (``head_map.routes_into``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kv_transfer.layout import KVLayout, KVLayoutError


def layout_to_proto(layout: KVLayout, msg=None):
    from kv_transfer.proto import kv_transfer_pb2 as pb

    msg = pb.KVLayout() if msg is None else msg
    msg.num_layers = layout.num_layers
    msg.block_size = layout.block_size
    msg.num_kv_heads = layout.num_kv_heads
    msg.head_dim = layout.head_dim
    msg.dtype = layout.dtype
    msg.tp_size = layout.tp_size
    msg.tp_rank = layout.tp_rank
    return msg


def layout_from_proto(msg) -> KVLayout:
    return KVLayout(
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=msg.dtype,
        tp_size=msg.tp_size,
        tp_rank=msg.tp_rank,
    )


@dataclass(frozen=True)
class KVDestination:
    """The decode side of one transfer: its ranks' receiver addresses (index = decode
    tensor-parallel rank), the blocks it reserved, and its pool layout."""

    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    layout: KVLayout
    backend: str = "gloo"

    def __post_init__(self):
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        if len(self.addresses) != self.layout.tp_size:
            raise KVLayoutError(
                f"KVDestination has {len(self.addresses)} addresses for a decode pool of "
                f"tensor_parallel={self.layout.tp_size}: one address per rank is needed"
            )

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    def to_proto(self, msg=None):
        from kv_transfer.proto import kv_transfer_pb2 as pb

        msg = pb.KVDestination() if msg is None else msg
        msg.addresses.extend(self.addresses)
        msg.block_ids.extend(self.block_ids)
        layout_to_proto(self.layout, msg.layout)
        msg.backend = self.backend
        return msg

    @classmethod
    def from_proto(cls, msg) -> KVDestination:
        return cls(
            addresses=tuple(msg.addresses),
            block_ids=tuple(msg.block_ids),
            layout=layout_from_proto(msg.layout),
            backend=msg.backend,
        )


@dataclass(frozen=True)
class KVHandoff:
    """A request leaving prefill: its tokens, first sampled token, where its KV sits in the
    prefill pool, and (once the decode instance reserved blocks) where it goes.

    ``transfer_id`` names one attempt (``request_id`` plus an attempt number, see
    ``transfer_id_for``): a retry on another pair gets a new one, so late bytes of a
    dropped attempt can never land in the retry's blocks.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    src_block_ids: tuple[int, ...]
    src_layout: KVLayout
    destination: KVDestination | None = None
    transfer_id: str = ""
    num_tokens: int = field(default=0)
    prefill_instance: str = ""
    sampler_state: bytes = b""  # a seeded request's generator state after the first token
    phase_times: dict[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        object.__setattr__(self, "src_block_ids", tuple(int(b) for b in self.src_block_ids))
        if not self.transfer_id:
            object.__setattr__(self, "transfer_id", transfer_id_for(self.request_id, 0))
        if not self.num_tokens:
            object.__setattr__(self, "num_tokens", len(self.prompt_token_ids))
        need = -(-self.num_tokens // self.src_layout.block_size)
        if len(self.src_block_ids) != need:
            raise KVLayoutError(
                f"handoff {self.request_id!r}: {self.num_tokens} tokens need {need} blocks of "
                f"{self.src_layout.block_size}, got {len(self.src_block_ids)} source block ids"
            )
        if self.destination is not None:
            self._check_destination(self.destination)

    def _check_destination(self, dst: KVDestination) -> None:
        self.src_layout.check_compatible(dst.layout)
        if len(dst.block_ids) != len(self.src_block_ids):
            raise KVLayoutError(
                f"handoff {self.request_id!r}: {len(self.src_block_ids)} source blocks but "
                f"{len(dst.block_ids)} reserved destination blocks"
            )

    def with_destination(self, destination: KVDestination) -> KVHandoff:
        return replace(self, destination=destination)

    def retry(self, attempt: int) -> KVHandoff:
        """The same request for another attempt: a new transfer id, no destination yet."""
        return replace(
            self, transfer_id=transfer_id_for(self.request_id, attempt), destination=None
        )

    def to_proto(self):
        from kv_transfer.proto import kv_transfer_pb2 as pb

        msg = pb.KVHandoff(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            first_token=self.first_token,
            src_block_ids=self.src_block_ids,
            transfer_id=self.transfer_id,
            num_tokens=self.num_tokens,
            prefill_instance=self.prefill_instance,
            sampler_state=self.sampler_state,
            phase_times=self.phase_times,
        )
        layout_to_proto(self.src_layout, msg.src_layout)
        if self.destination is not None:
            self.destination.to_proto(msg.destination)
        return msg

    @classmethod
    def from_proto(cls, msg) -> KVHandoff:
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=tuple(msg.prompt_token_ids),
            first_token=msg.first_token,
            src_block_ids=tuple(msg.src_block_ids),
            src_layout=layout_from_proto(msg.src_layout),
            destination=KVDestination.from_proto(msg.destination)
            if msg.HasField("destination")
            else None,
            transfer_id=msg.transfer_id,
            num_tokens=msg.num_tokens,
            prefill_instance=msg.prefill_instance,
            sampler_state=msg.sampler_state,
            phase_times=dict(msg.phase_times),
        )

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandoff:
        from kv_transfer.proto import kv_transfer_pb2 as pb

        return cls.from_proto(pb.KVHandoff.FromString(data))


def transfer_id_for(request_id: str, attempt: int) -> str:
    return f"{request_id}#{attempt}"
