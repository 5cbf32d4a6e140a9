"""``python -m kv_transfer.proto``: generate the gRPC stubs now (for a read-only install)."""

from kv_transfer.proto import generate

generate(force=True)
print("kv_transfer.proto: stubs generated")
