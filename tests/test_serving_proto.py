"""The committed gRPC modules are what grpc_tools makes of serving/proto/v41.proto today (a proto
edit without regenerating fails here), and the proto's enums match the engine's finish reasons."""

import shutil

import pytest

from tests.engine_common import ROOT
from v41_jax.runtime.request import FINISH_REASONS

PROTO = "serving/proto/v41.proto"
GENERATED = ("serving/proto/v41_pb2.py", "serving/proto/v41_pb2_grpc.py")


def test_generated_code_matches_the_proto(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    (tmp_path / "serving" / "proto").mkdir(parents=True)
    shutil.copy(ROOT / PROTO, tmp_path / PROTO)
    # the same command as the proto's header, from a copy of the tree's root
    rc = protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      str(tmp_path / PROTO)])
    assert rc == 0
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), \
            f"{name} is stale: python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. {PROTO}"


def test_finish_reasons_cover_the_engine():
    from serving.grpc_server import FINISH
    from serving.proto import v41_pb2

    assert set(FINISH) == set(FINISH_REASONS)
    assert {v41_pb2.FinishReason.Name(v) for v in FINISH.values()} == {r.upper() for r in FINISH_REASONS}
