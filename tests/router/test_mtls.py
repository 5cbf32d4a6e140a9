"""mTLS (``router.tls.client_ca_file``) on both front ends, served for real (grpc.aio and
aiohttp on this test's loop, the official grpc client and httpx) with trustme's test
CA: a client with a certificate from the CA gets answers, one without is refused at the
handshake, on both ports. The front ends' health needs no engine, so the core here only
says it serves."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx
import pytest
import trustme

from pdserve.router.admission import CallLimit
from pdserve.router.client import RouterClient
from pdserve.router.grpc_api import GrpcApi
from pdserve.router.http_api import HttpApi
from pdserve.router.metrics import RouterMetrics


class ServingCore:
    serving = True

    def __init__(self):
        self.calls = CallLimit(4)
        self.metrics = RouterMetrics("m", {"ttft_ms": 1000.0, "tpot_ms": 150.0})


def test_a_client_needs_a_certificate_of_the_client_ca(tmp_path):
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client@pdserve")
    files = {}
    for name, blob in (
        ("ca", ca.cert_pem),
        ("cert", server.cert_chain_pems[0]),
        ("key", server.private_key_pem),
        ("client_cert", client.cert_chain_pems[0]),
        ("client_key", client.private_key_pem),
    ):
        files[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(files[name])
    tls = {"cert_file": files["cert"], "key_file": files["key"], "client_ca_file": files["ca"]}

    async def run():
        core = ServingCore()
        grpc_api, http_api = GrpcApi(core, tls=tls), HttpApi(core, "m", tls=tls)
        port = await grpc_api.start("127.0.0.1", 0)
        http_port = await http_api.start("127.0.0.1", 0)
        address, url = f"127.0.0.1:{port}", f"https://127.0.0.1:{http_port}/health"
        try:
            await grpc_api.set_serving(True)
            mine = dict(cert_file=files["client_cert"], key_file=files["client_key"])
            with RouterClient(address, ca_file=files["ca"], **mine) as c:
                assert await asyncio.to_thread(c.health) == "SERVING"
            with RouterClient(address, ca_file=files["ca"]) as anonymous:
                with pytest.raises(grpc.RpcError) as err:
                    await asyncio.to_thread(anonymous.health, "", 5.0)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            verify = ssl.create_default_context(cafile=files["ca"])
            verify.load_cert_chain(files["client_cert"], files["client_key"])
            async with httpx.AsyncClient(verify=verify) as h:
                assert (await h.get(url)).status_code == 200
            plain = ssl.create_default_context(cafile=files["ca"])
            async with httpx.AsyncClient(verify=plain) as h:
                with pytest.raises(httpx.TransportError):
                    await h.get(url)
        finally:
            await grpc_api.stop(0)
            await http_api.stop()

    asyncio.run(run())
