"""Our ggml tables against the pinned libggml itself: type traits, op names, and kernel coverage."""

import ctypes as C

import pytest

from kernels import load_all
from kernels.registry import KERNELS
from wire.ggml import TYPE_COUNT, TYPE_TRAITS, GGMLGluOp, GGMLOp, GGMLType, GGMLUnaryOp

import ggml_oracle


@pytest.fixture(scope="module")
def libggml():
    base, _ = ggml_oracle._libs()
    for fn, res in (("ggml_blck_size", C.c_int64), ("ggml_type_size", C.c_size_t), ("ggml_op_name", C.c_char_p),
                    ("ggml_unary_op_name", C.c_char_p), ("ggml_glu_op_name", C.c_char_p), ("ggml_op_symbol", C.c_char_p)):
        getattr(base, fn).restype = res
        getattr(base, fn).argtypes = [C.c_int]
    return base


def test_type_traits_match_ggml(libggml):
    for t in range(TYPE_COUNT):
        blck = libggml.ggml_blck_size(t)
        if t not in GGMLType._value2member_map_:
            assert blck == 0, f"type {t} is live in ggml but missing here"
            continue
        traits = TYPE_TRAITS[GGMLType(t)]
        assert (traits.block_size, traits.type_size) == (blck, libggml.ggml_type_size(t)), GGMLType(t).name


def test_op_numbering_matches_ggml(libggml):
    for op in GGMLOp:
        assert libggml.ggml_op_name(op).decode() == op.name, op
    for op in GGMLUnaryOp:
        assert libggml.ggml_unary_op_name(op).decode() == op.name
    for op in GGMLGluOp:
        assert libggml.ggml_glu_op_name(op).decode() == op.name


def test_every_op_a_llama_client_sends_has_a_kernel():
    load_all()
    needed = {(GGMLOp.ADD, 0), (GGMLOp.MUL, 0), (GGMLOp.RMS_NORM, 0), (GGMLOp.MUL_MAT, 0), (GGMLOp.GET_ROWS, 0),
              (GGMLOp.ROPE, 0), (GGMLOp.FLASH_ATTN_EXT, 0), (GGMLOp.SOFT_MAX, 0), (GGMLOp.GLU, GGMLGluOp.SWIGLU),
              (GGMLOp.SET_ROWS, 0), (GGMLOp.DUP, 0), (GGMLOp.CPY, 0), (GGMLOp.CONT, 0), (GGMLOp.SCALE, 0)}
    assert {(int(o), int(s)) for o, s in needed} <= set(KERNELS)
