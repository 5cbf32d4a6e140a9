"""What stands between a gRPC call and a handler of ``pdserve.v1.Router``
(router/grpc_api.py): the service's registration, through which request bytes that
protobuf cannot parse reach the handler as ``Unparsable`` (answered INVALID_ARGUMENT,
where grpc would answer UNKNOWN with the parser's text), and ``GrpcAuth``, the
interceptor that refuses a call without a known API key (UNAUTHENTICATED) before its
handler runs, other services (``grpc.health.v1``) passing; ``peer_address``, the
client address a call is counted under when there are no keys (docs/serving.md,
"Authentication, TLS and limits")."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError

from pdserve.router import pdserve_pb2 as pb
from pdserve.router.auth import ApiKeys, refusal
from pdserve.router.incidents import first_line

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Router"].full_name  # pdserve.v1.Router


class Unparsable:
    """A request protobuf could not parse (bad wire bytes, a string that is not UTF-8):
    its handler answers INVALID_ARGUMENT with ``message``."""

    def __init__(self, type_name: str, error: DecodeError):
        self.message = f"the request is not a valid {type_name}: {first_line(error)}"


def _parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Unparsable(message_type.DESCRIPTOR.full_name, e)

    return parse


def add_router(service, server) -> None:
    """Register ``service`` as the generated ``add_RouterServicer_to_server`` does,
    except that a request protobuf cannot parse reaches its handler as ``Unparsable``
    (grpc would answer UNKNOWN with the parser's exception text)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Router"].methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        make = grpc.unary_unary_rpc_method_handler
        if method.server_streaming:
            make = grpc.unary_stream_rpc_method_handler
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=_parser(request),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GrpcAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call to ``pdserve.v1.Router`` without a known key,
    counted with ``refused("unauthenticated")``; other services (health) pass."""

    def __init__(self, keys: ApiKeys, refused: Callable[[str], None]):
        self.keys, self.refused = keys, refused

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.keys.owner(metadata.get("authorization")) is not None:
            return handler
        self.refused("unauthenticated")
        message = refusal("the metadata 'authorization'")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, as a streaming handler is

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )


def peer_address(peer: str) -> str:
    """The client's address in a gRPC peer string, without its port:
    ``ipv4:10.0.0.7:5123`` -> ``10.0.0.7``, ``ipv6:%5B::1%5D:5123`` -> ``::1``; any
    other kind (``unix:...``) whole."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer
