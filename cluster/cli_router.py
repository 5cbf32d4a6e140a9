"""The ``pdserve`` commands that talk to a running router over gRPC (``generate``,
``stats``, and ``up --demo``), with the router's API key and TLS CA when it has them
(docs/serving.md, "Authentication, TLS and limits")."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_ROUTER = os.environ.get("PDSERVE_ROUTER", "127.0.0.1:50051")
# the client side of router.api_key_file and router.tls (docs/serving.md)
DEFAULT_API_KEY = os.environ.get("PDSERVE_API_KEY")
DEFAULT_CA_FILE = os.environ.get("PDSERVE_CA_FILE")


def _summary(address: str, chunk) -> str:
    """The last chunk's usage and timings on one line (and the KV handoff when there was one)."""
    t = chunk.timings
    cached = f" ({chunk.cached_tokens} cached)" if chunk.cached_tokens else ""
    line = (
        f"[{address}: prompt {chunk.prompt_tokens} tokens{cached}, "
        f"TTFT {t.ttft_ms:.0f} ms, {chunk.completion_tokens} tokens, "
        f"TPOT {t.tpot_ms:.1f} ms, e2e {t.e2e_ms:.0f} ms, "
        f"queue {t.queue_ms:.1f} ms, on {', '.join(t.instances)}, "
        f"finish {chunk.finish_reason}]"
    )
    if t.kv_bytes:
        p = t.phases
        line += (
            f"\n[KV handoff {' -> '.join(t.instances[-2:])}: {t.kv_bytes / 1e6:.2f} MB in "
            f"{t.transfer_ms:.1f} ms; prefill {p.get('prefill_start', 0):.0f}-"
            f"{p.get('prefill_end', 0):.0f} ms, transfer {p.get('transfer_start', 0):.0f}-"
            f"{p.get('transfer_end', 0):.0f} ms, decode from {p.get('decode_start', 0):.0f} ms "
            "after arrival]"
        )
    return line


def stream_to_terminal(
    address: str,
    prompt: str,
    chat: bool,
    api_key: str | None = None,
    ca_file: str | None = None,
    **sampling,
) -> int:
    """Send one request through the router and print its answer as it streams."""
    import grpc

    from pdserve.router.client import RouterClient

    kw = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    with RouterClient(address, api_key=api_key, ca_file=ca_file) as client:
        try:
            for chunk in client.generate(**kw, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finished:
                    print(f"\n{_summary(address, chunk)}")
        except grpc.RpcError as e:
            print(f"\npdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def show_stats(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.router.client import RouterClient

    with RouterClient(args.router, api_key=args.api_key, ca_file=args.ca_file) as client:
        try:
            s = client.stats()
        except grpc.RpcError as e:
            print(f"pdserve stats: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(f"router {args.router}: queued {s.queued}/{s.max_queue}, in flight {s.in_flight}")
    for i in s.instances:
        print(
            f"  {i.name}: queued {i.queued}, running {i.running}, outstanding {i.outstanding}, "
            f"blocks free {i.free_blocks}/{i.total_blocks}, requests {i.requests_total}, "
            f"tokens {i.tokens_total}, kernels {i.kernels}"
        )
    return 0


def client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key", default=DEFAULT_API_KEY, help="a key of router.api_key_file ($PDSERVE_API_KEY)"
    )
    parser.add_argument(
        "--ca-file",
        default=DEFAULT_CA_FILE,
        help="PEM CA of the router's TLS certificate ($PDSERVE_CA_FILE)",
    )
