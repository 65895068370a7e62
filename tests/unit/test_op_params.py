"""wire.op_params: one layout per op, used by the orchestrator to encode and by the kernels to decode."""
from __future__ import annotations

import struct

import pytest

from wire import op_params
from wire.ggml import MAX_OP_PARAMS, GGMLOp

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("op", sorted(op_params.OP_PARAMS), ids=lambda op: op.name)
def test_layouts_fit_and_round_trip(op):
    layout = op_params.OP_PARAMS[op]
    assert layout.size <= MAX_OP_PARAMS
    values = {name: (i + 1) * (0.5 if code == "f" else 1) for i, (name, code) in enumerate(layout.fields)}
    decoded = vars(layout.decode(layout.encode(**values).ljust(MAX_OP_PARAMS, b"\0")))
    assert decoded == pytest.approx(values)


def test_rope_layout_is_ggmls():
    """ggml_rope_impl's int32 slots: [1] n_dims, [2] mode, [4] n_ctx_orig, [5..10] six floats, [11..14]
    sections, [15] n_offs (hand-derived from ggml.c)."""
    raw = op_params.encode(GGMLOp.ROPE, n_dims=64, mode=2, n_ctx_orig=4096, freq_base=1e4, beta_fast=32.0,
                           section2=7, n_offs=5)
    ints = struct.unpack("<16i", raw)
    floats = struct.unpack("<16f", raw)
    assert (ints[1], ints[2], ints[4], ints[13], ints[15]) == (64, 2, 4096, 7, 5)
    assert (floats[5], floats[9]) == (1e4, 32.0)


def test_unknown_field_is_refused():
    with pytest.raises(TypeError, match="unknown"):
        op_params.encode(GGMLOp.SOFT_MAX, scale=1.0, sclae=2.0)
