"""Build step of the package: the protobuf and gRPC stubs of ``router/pdserve.proto`` and
``kv_transfer/kv_transfer.proto``, generated beside them by grpc_tools (a build
requirement, pinned to the grpcio-tools the runtime installs) when the package is built
or installed, editable installs included; they are never committed (.gitignore)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ["pdserve/router/pdserve.proto", "pdserve/kv_transfer/kv_transfer.proto"]


class BuildWithStubs(build_py):
    def run(self):
        from grpc_tools import protoc

        include = Path(protoc.__file__).resolve().parent / "_proto"
        # editable: beside the sources, which the install points at; else into the build
        out = ROOT if self.editable_mode else Path(self.build_lib)
        for proto in PROTOS:
            (out / proto).parent.mkdir(parents=True, exist_ok=True)
            args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}"]
            args += [f"--pyi_out={out}", f"--grpc_python_out={out}", proto]
            if protoc.main(args) != 0:
                raise RuntimeError(f"grpc_tools.protoc failed on {proto}")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
