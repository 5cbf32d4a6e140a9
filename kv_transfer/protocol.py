"""What the two sides of a transfer tell each other, and how a transfer can fail.

``KVDestination`` is the decode instance's answer to a reservation (where KV goes);
``Handoff`` is what the END of source rank 0 carries (what decode needs to run the
request); ``Status`` is a receiver's acknowledgement of one source's END. Both records
travel as protobuf bytes (``kv_transfer.proto``), never pickled. Every error names the
transfer and what went wrong.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import IntEnum

from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError

WILDCARDS = ("0.0.0.0", "::", "")  # bind addresses that listen on every interface


class KVTransferError(RuntimeError):
    """A transfer failed: the peer is gone, refused it, or the data did not arrive intact."""


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer made no progress within its lease (or the given timeout)."""


class KVChecksumError(KVTransferError):
    """A segment's bytes differ from what the sender summed: the transfer is dropped."""


class KVPeerError(KVTransferError):
    """The connection to the other side failed or was lost."""


class Status(IntEnum):
    """A receiver's answer to one source's END (``PushAck.Status`` on the grpc wire)."""

    OK = 0
    INCOMPLETE = 1
    CHECKSUM = 2
    UNKNOWN = 3
    REJECTED = 4

    def error(self, transfer_id: str, peer: str, text: str) -> KVTransferError | None:
        """The sender's error for this answer (None for OK)."""
        if self == Status.OK:
            return None
        why = f"KV transfer {transfer_id!r} to {peer}: receiver answered {self.name}"
        why += f" ({text})" if text else ""
        return KVChecksumError(why) if self == Status.CHECKSUM else KVTransferError(why)


def status_of(error: KVTransferError) -> Status:
    """What a failed transfer acknowledges to its sources."""
    if isinstance(error, KVChecksumError):
        return Status.CHECKSUM
    return Status.UNKNOWN if isinstance(error, KVTransferTimeout) else Status.REJECTED


def endpoint(bind: str | None = None, advertise: str | None = None) -> tuple[str, str]:
    """(the interface a worker's KV endpoints listen on, the address peers are told).

    ``bind`` None: this node's Ray address in a Ray worker, else loopback (the cluster
    passes 127.0.0.1 for an embedded Ray, cluster/supervisor.py). ``advertise`` None:
    ``bind``, or the node's Ray address when ``bind`` is a wildcard (0.0.0.0, ::)."""
    if bind is not None and (advertise is not None or bind not in WILDCARDS):
        return bind, advertise or bind  # no node address needed
    import ray

    node: str = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    bind = bind or node
    return bind, advertise or (node if bind in WILDCARDS else bind)


def transfer_key(token: str) -> int:
    """A 63-bit integer naming a transfer's token (the gloo/nccl header has no strings)."""
    digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def check_layer_skip(layer_skip: tuple[int, ...], num_layers: int, num_blocks: int) -> None:
    """Raise unless ``layer_skip`` is empty or one entry per layer in ``[0, num_blocks)``
    (``KVDestination.layer_skip``: each layer receives at least one of the blocks)."""
    if layer_skip and len(layer_skip) != num_layers:
        raise KVLayoutError(
            f"layer_skip has {len(layer_skip)} entries for {num_layers} "
            "layers: allowed one per layer, or none"
        )
    if bad := [(i, s) for i, s in enumerate(layer_skip) if not 0 <= s < num_blocks]:
        (i, s), why = bad[0], "a layer receives at least one"
        raise KVLayoutError(
            f"layer_skip[{i}]={s}: allowed [0, {num_blocks}) for {num_blocks} blocks sent ({why})"
        )


@dataclass(frozen=True)
class KVDestination:
    """The decode side of one transfer: its ranks' receiver addresses (index = decode
    tensor-parallel rank), the blocks to write, its pool layout, and the transfer's
    ``token``: its name on the wire, minted by the receiver (``KVReceiver.expect``), 128
    random bits, never derived from a request id, so that only whoever was given this
    destination can name the transfer.

    ``outside_blocks``: for a model whose every layer slides (``ModelConfig.cache_window``),
    the request's leading blocks wholly before the window of its next token; nobody
    reads them again, so they are not sent and the decode instance holds placeholders
    for them (engine/block_manager.py). ``cached_blocks``: the blocks after those that
    the decode instance already holds (shared from its prefix cache at ``reserve``); they
    are not sent either. The request's block list there is then ``outside_blocks``
    placeholders, ``cached_blocks`` held blocks and ``block_ids``: the sender sends its
    own table's blocks from position ``outside_blocks + cached_blocks`` on
    (``source_blocks``), the i-th of them into ``block_ids[i]``.

    ``layer_skip``: per layer, the leading blocks of that sent list (of ``block_ids``)
    the layer does not receive: for a sliding layer of a model whose windows differ or
    that has global layers too (Gemma 2/3), those wholly before its window at the next
    token; 0 for a global layer. Empty: every layer receives every block. Invariant:
    empty or one entry per layer, each in ``[0, len(block_ids))`` (a layer always
    receives at least the last block). The decode instance decides it at ``reserve``;
    the sender sends, and every receiver expects, exactly layer ``l``'s blocks
    ``[layer_skip[l], len(block_ids))``; ``KVLayout.transfer_bytes`` counts them."""

    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    layout: KVLayout
    backend: str = "gloo"
    token: str = ""
    cached_blocks: int = 0
    outside_blocks: int = 0
    layer_skip: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "layer_skip", tuple(int(s) for s in self.layer_skip))
        check_layer_skip(self.layer_skip, self.layout.num_layers, len(self.block_ids))
        if len(self.addresses) != self.layout.tp_size:
            raise KVLayoutError(
                f"KVDestination has {len(self.addresses)} addresses for a decode pool of "
                f"tensor_parallel={self.layout.tp_size}: one address per rank is needed"
            )
        for key in ("cached_blocks", "outside_blocks"):
            if getattr(self, key) < 0:
                raise KVLayoutError(f"KVDestination.{key}={getattr(self, key)}: must be >= 0")

    def skip(self, layer: int) -> int:
        """The leading blocks of ``block_ids`` that ``layer`` does not receive."""
        return self.layer_skip[layer] if self.layer_skip else 0

    def source_blocks(self, table) -> list[int]:
        """The blocks of the sender's ``table`` (the request's whole block list there) to
        send: those past the ``outside_blocks`` and ``cached_blocks`` the destination
        does not need, one per block of ``block_ids``."""
        skip = self.outside_blocks + self.cached_blocks
        send = [int(b) for b in table[skip:]]
        if len(send) != len(self.block_ids):
            raise KVLayoutError(
                f"the source holds {len(table)} blocks for this request; the destination "
                f"skips {self.outside_blocks} outside the window, holds {self.cached_blocks} "
                f"and reserved {len(self.block_ids)}: {len(table)} - {skip} must equal "
                f"{len(self.block_ids)}"
            )
        return send

    def to_proto(self, msg=None) -> pb.KVDestination:
        msg = pb.KVDestination() if msg is None else msg
        msg.addresses.extend(self.addresses)
        msg.block_ids.extend(self.block_ids)
        self.layout.to_proto(msg.layout)
        msg.backend = self.backend
        msg.token = self.token
        msg.cached_blocks = self.cached_blocks
        msg.outside_blocks = self.outside_blocks
        msg.layer_skip.extend(self.layer_skip)
        return msg

    @classmethod
    def from_proto(cls, msg: pb.KVDestination) -> KVDestination:
        layout = KVLayout.from_proto(msg.layout)
        return cls(
            tuple(msg.addresses),
            tuple(msg.block_ids),
            layout,
            msg.backend,
            msg.token,
            msg.cached_blocks,
            msg.outside_blocks,
            tuple(msg.layer_skip),
        )

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> KVDestination:
        return cls.from_proto(pb.KVDestination.FromString(data))


@dataclass(frozen=True)
class Handoff:
    """A request leaving prefill, as the END of source rank 0 carries it: the first token
    sampled there, the prefill's phase times (wall clock: prefill_start, prefill_end,
    transfer_start) and the instance's name. No sampler state: a seeded request's draws
    are keyed by (seed, output position) (``engine.sampler``) and its penalties read its
    tokens, so decode needs none.

    A request that asked for logprobs also carries the first token's: ``first_logprob``
    (None: it did not ask) and its ``top_ids`` / ``top_logprobs`` (same length, most
    likely first; float32 values, exact on the wire).

    ``cached_tokens``: the prompt tokens the prefill instance served from its prefix
    cache (their KV was not computed for this request); the decode instance reports it
    to the router with the request's first token (``Update.info["cached_tokens"]``).

    A request that asked for its prompt's logprobs carries them, columns over its prompt
    tokens after the first: ``prompt_top`` (None: it did not ask) alternatives per token,
    ``prompt_logprobs`` and ``prompt_ranks`` one per token, ``prompt_top_ids`` and
    ``prompt_top_logprobs`` ``prompt_top`` per token, concatenated.

    A request of n choices carries choices 1 .. n - 1's first tokens (``choice_tokens``,
    drawn with ``first_token``; they fork where the KV lands) and, when it asked for
    logprobs, one ``choice_logprobs`` each and ``len(top_ids)`` alternatives each
    (``choice_top_ids`` / ``choice_top_logprobs``, concatenated)."""

    first_token: int
    phase_times: dict[str, float] = field(default_factory=dict, compare=False)
    prefill_instance: str = ""
    first_logprob: float | None = None
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    cached_tokens: int = 0
    prompt_top: int | None = None
    prompt_logprobs: tuple[float, ...] = ()
    prompt_ranks: tuple[int, ...] = ()
    prompt_top_ids: tuple[int, ...] = ()
    prompt_top_logprobs: tuple[float, ...] = ()
    choice_tokens: tuple[int, ...] = ()
    choice_logprobs: tuple[float, ...] = ()
    choice_top_ids: tuple[int, ...] = ()
    choice_top_logprobs: tuple[float, ...] = ()

    def __post_init__(self):
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError(
                f"Handoff: {len(self.top_ids)} top_ids and {len(self.top_logprobs)} "
                "top_logprobs; they must pair up"
            )
        n, k = len(self.prompt_logprobs), self.prompt_top or 0
        if len(self.prompt_ranks) != n or not (
            len(self.prompt_top_ids) == len(self.prompt_top_logprobs) == n * k
        ):
            raise ValueError(
                f"Handoff: {n} prompt_logprobs, {len(self.prompt_ranks)} prompt_ranks, "
                f"{len(self.prompt_top_ids)} prompt_top_ids and {len(self.prompt_top_logprobs)} "
                f"prompt_top_logprobs with prompt_top={self.prompt_top}; must be n, n, n*k, n*k"
            )
        c, k = len(self.choice_tokens), len(self.top_ids)
        asked = self.first_logprob is not None
        if len(self.choice_logprobs) != (c if asked else 0) or not (
            len(self.choice_top_ids) == len(self.choice_top_logprobs) == c * k
        ):
            raise ValueError(
                f"Handoff: {c} choice_tokens, {len(self.choice_logprobs)} choice_logprobs, "
                f"{len(self.choice_top_ids)} choice_top_ids and "
                f"{len(self.choice_top_logprobs)} choice_top_logprobs with {k} top_ids and "
                f"first_logprob {'set' if asked else 'unset'}; must be c, c (0 unset), c*k, c*k"
            )

    def to_bytes(self) -> bytes:
        msg = pb.Handoff(
            first_token=self.first_token,
            phase_times=self.phase_times,
            prefill_instance=self.prefill_instance,
            first_logprob=self.first_logprob,
            top_ids=self.top_ids,
            top_logprobs=self.top_logprobs,
            cached_tokens=self.cached_tokens,
            prompt_top=self.prompt_top,
            prompt_logprobs=self.prompt_logprobs,
            prompt_ranks=self.prompt_ranks,
            prompt_top_ids=self.prompt_top_ids,
            prompt_top_logprobs=self.prompt_top_logprobs,
            choice_tokens=self.choice_tokens,
            choice_logprobs=self.choice_logprobs,
            choice_top_ids=self.choice_top_ids,
            choice_top_logprobs=self.choice_top_logprobs,
        )
        return msg.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> Handoff:
        msg = pb.Handoff.FromString(data)
        times = dict(msg.phase_times)
        logprob = msg.first_logprob if msg.HasField("first_logprob") else None
        return cls(
            msg.first_token,
            times,
            msg.prefill_instance,
            logprob,
            tuple(msg.top_ids),
            tuple(msg.top_logprobs),
            msg.cached_tokens,
            msg.prompt_top if msg.HasField("prompt_top") else None,
            tuple(msg.prompt_logprobs),
            tuple(msg.prompt_ranks),
            tuple(msg.prompt_top_ids),
            tuple(msg.prompt_top_logprobs),
            tuple(msg.choice_tokens),
            tuple(msg.choice_logprobs),
            tuple(msg.choice_top_ids),
            tuple(msg.choice_top_logprobs),
        )
