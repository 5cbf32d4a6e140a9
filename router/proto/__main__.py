"""``python -m router.proto``: generate the gRPC stubs now (setup.sh runs it)."""

from router.proto import generate

generate(force=True)
print("router.proto: stubs generated")
