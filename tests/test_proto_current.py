"""The grpclib bindings in proto/ match the installed smg-grpc-proto package.

Fails when the package was upgraded (or a binding edited by hand) without
re-running ``python -m enginelink.tools.regen_proto``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from enginelink.tools import regen_proto

VLLM_RPCS = {
    "Generate",
    "HealthCheck",
    "GetModelInfo",
    "GetServerInfo",
    "Abort",
    "GetTokenizer",
    "GetLoads",
    "SubscribeKvEvents",
    "FlushCache",
    "StartProfile",
    "StopProfile",
    "Embed",
}


@pytest.mark.process
def test_bindings_are_current():
    done = subprocess.run(
        [sys.executable, "-m", "enginelink.tools.regen_proto", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.process
def test_check_names_a_stale_file(tmp_path):
    for path in regen_proto.generate(tmp_path):
        assert path.read_text().startswith(regen_proto.header_line())
    (tmp_path / "vllm_engine_grpc.py").write_text("# edited by hand\n")
    (tmp_path / "gone_grpc.py").write_text("")
    assert regen_proto.stale_files(tmp_path) == [
        "gone_grpc.py (extra: no such .proto in smg-grpc-proto)",
        "vllm_engine_grpc.py (out of date)",
    ]


def test_vllm_engine_base_exposes_the_contract():
    from enginelink.proto.vllm_engine_grpc import VllmEngineBase

    assert VLLM_RPCS <= VllmEngineBase.__abstractmethods__

    async def _unused(self, stream):  # pragma: no cover - never called
        raise NotImplementedError

    concrete = type("Concrete", (VllmEngineBase,), dict.fromkeys(VLLM_RPCS, _unused))
    paths = set(concrete().__mapping__())
    assert paths >= {f"/vllm.grpc.engine.VllmEngine/{rpc}" for rpc in VLLM_RPCS}


def test_messages_are_the_packages_own_classes():
    from smg_grpc_proto.generated import vllm_engine_pb2

    from enginelink.proto import vllm_engine_grpc

    assert vllm_engine_grpc.vllm_engine_pb2 is vllm_engine_pb2
