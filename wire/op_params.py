"""Each op's parameters (ggml_tensor.op_params, 64 bytes) declared once: the orchestrator encodes nodes
with these layouts and the kernels decode them with the same ones, so the two sides cannot drift.

A layout is a list of (field, struct code) in order; fields left out when encoding are 0, and the
bytes after the layout are 0 (ggml zero-fills op_params). Slots ggml leaves unused keep a name
saying so, so later fields stay at their offsets.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from types import SimpleNamespace

from .ggml import MAX_OP_PARAMS, GGMLOp

PREC_DEFAULT = 0  # GGML_PREC_DEFAULT
PREC_F32 = 10  # GGML_PREC_F32: ggml-cpu computes in F32 either way
HINT_SRC0_IS_HADAMARD = 1  # MUL_MAT hint (ggml_mul_mat_set_hint): src0 is a normalized Hadamard matrix


@dataclass(frozen=True)
class Layout:
    fields: tuple[tuple[str, str], ...]

    def __post_init__(self):
        if self.size > MAX_OP_PARAMS:
            raise ValueError(f"op params layout of {self.size} bytes exceeds {MAX_OP_PARAMS}")

    @property
    def format(self) -> str:
        return "<" + "".join(code for _, code in self.fields)

    @property
    def size(self) -> int:
        return struct.calcsize(self.format)

    def encode(self, **values) -> bytes:
        names = {name for name, _ in self.fields}
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"unknown op params {sorted(unknown)}")
        return struct.pack(self.format, *(values.get(name, 0) for name, _ in self.fields))

    def decode(self, raw: bytes) -> SimpleNamespace:
        """Fields from op_params bytes (at least the layout's size; ggml sends all 64)."""
        values = struct.unpack_from(self.format, raw)
        return SimpleNamespace(**{name: value for (name, _), value in zip(self.fields, values)})


def _layout(spec: str) -> Layout:
    """'name:code name:code ...' -> Layout."""
    return Layout(tuple(tuple(item.split(":")) for item in spec.split()))


# as ggml.c's constructors write them
OP_PARAMS: dict[GGMLOp, Layout] = {
    GGMLOp.VIEW: _layout("offset:Q"),
    GGMLOp.PERMUTE: _layout("axis0:i axis1:i axis2:i axis3:i"),
    GGMLOp.RMS_NORM: _layout("eps:f"),
    GGMLOp.NORM: _layout("eps:f"),
    GGMLOp.L2_NORM: _layout("eps:f"),
    GGMLOp.ROPE: _layout("unused0:i n_dims:i mode:i unused3:i n_ctx_orig:i freq_base:f freq_scale:f ext_factor:f"
                         " attn_factor:f beta_fast:f beta_slow:f section0:i section1:i section2:i section3:i"
                         " n_offs:i"),
    GGMLOp.FLASH_ATTN_EXT: _layout("scale:f max_bias:f softcap:f prec:i"),
    GGMLOp.CONCAT: _layout("dim:i"),
    GGMLOp.SOFT_MAX: _layout("scale:f max_bias:f"),
    GGMLOp.GLU: _layout("op:i swapped:i"),
    GGMLOp.SCALE: _layout("scale:f bias:f"),
    GGMLOp.UNARY: _layout("op:i"),
    GGMLOp.ARGSORT: _layout("order:i"),
    GGMLOp.CLAMP: _layout("min:f max:f"),
    GGMLOp.MUL_MAT: _layout("prec:i hint:i"),
}


def encode(op: GGMLOp, /, **values) -> bytes:
    return OP_PARAMS[op].encode(**values)


def decode(op: GGMLOp, raw: bytes) -> SimpleNamespace:
    return OP_PARAMS[op].decode(raw)
