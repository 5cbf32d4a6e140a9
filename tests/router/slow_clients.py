"""Slow HTTP clients, as a process of their own (tests/router/test_slow_clients.py):

    python -m tests.router.slow_clients HOST PORT COUNT SOURCE

opens COUNT TCP connections from the address SOURCE to HOST:PORT (as many as its open
files allow: the soft RLIMIT_NOFILE is raised to the hard one first), on each sends a
generate request's headers (``Content-Length: 1024``) and one byte of its body, prints
``open N`` (the connections it holds) and holds them, sending nothing more, until its
standard input closes."""

from __future__ import annotations

import resource
import socket
import sys

SPARE_FILES = 64  # open files left for the interpreter itself


def main() -> None:
    host, port, count, source = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count = min(count, hard - SPARE_FILES)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1024\r\n\r\n{"
    ).encode()
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.connect((host, port))
        s.sendall(head)
        held.append(s)
    print(f"open {len(held)}", flush=True)
    sys.stdin.read()
    for s in held:
        s.close()


if __name__ == "__main__":
    main()
