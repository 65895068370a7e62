"""Our numberings against the pinned llama.cpp's own source (the sdist install_reference.sh extracts):
the RPC command enum and protocol version (ggml-rpc), and the op enum (ggml.h), read from the C text
rather than restated here."""
from __future__ import annotations

import re

import pytest

from wire.ggml import OP_COUNT, GGMLOp
from wire import protocol as p
from wire.protocol import Command

from .conftest import _located, reference

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def source_dir():
    def locate():
        folder = reference.llama_source_dir()
        if not (folder / "ggml" / "include" / "ggml.h").is_file():
            raise reference.ReferenceMissing(f"{folder} has no ggml/include/ggml.h; run tools/install_reference.sh")
        return folder

    return _located(locate)


def enum_members(text: str, enum: str, prefix: str) -> list[str]:
    """Member names of a C enum in order (each numbered one past the previous: the enums here are)."""
    body = re.search(rf"enum {enum}\s*\{{(.*?)\}};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S)
    names = re.findall(rf"\b({prefix}\w+)\s*(?:=\s*0\s*)?,", body)
    assert names, f"no members found in enum {enum}"
    return [n.removeprefix(prefix) for n in names]


def test_rpc_commands_and_version(source_dir):
    rpc = source_dir / "ggml" / "src" / "ggml-rpc" / "ggml-rpc.cpp"
    members = enum_members(rpc.read_text(), "rpc_cmd", "RPC_CMD_")
    assert members[-2:] == ["NONE", "COUNT"]
    upstream = members[:-2]
    assert [c.name for c in Command if c < len(upstream)] == upstream
    assert p.UPSTREAM_COMMAND_COUNT == len(upstream)
    header = (source_dir / "ggml" / "include" / "ggml-rpc.h").read_text()
    version = tuple(int(re.search(rf"RPC_PROTO_{part}_VERSION\s+(\d+)", header).group(1))
                    for part in ("MAJOR", "MINOR", "PATCH"))
    assert p.PROTOCOL_VERSION == version


def test_op_enum(source_dir):
    members = enum_members((source_dir / "ggml" / "include" / "ggml.h").read_text(), "ggml_op", "GGML_OP_")
    assert members[-1] == "COUNT"
    assert [op.name for op in GGMLOp] == members[:-1]
    assert OP_COUNT == len(members) - 1
