"""Every ggml storage format's numpy dequantizer, in one table.

The legacy block formats (quants.py) and the K-quant/IQ4 ones (kquants.py) each define their own
dequantizers; this table joins them with the plain float types, so whoever turns stored rows into
float32 — the worker's GET_ROWS and reference twins, the orchestrator's embedding lookup — knows the
same set of types and no caller can miss one.
"""
from __future__ import annotations

import numpy as np

from wire.ggml import TYPE_TRAITS, GGMLType

from . import kquants, quants

DEQUANTIZE = {**quants.DEQUANTIZE, **kquants.DEQUANTIZE}  # (n_blocks, type_size) uint8 -> float32 values


def dequantize_rows(type_: GGMLType, rows: np.ndarray) -> np.ndarray:
    """(..., row_bytes) uint8 rows of `type_` -> (..., ne0) float32, as ggml's CPU dequantizes them."""
    tt = TYPE_TRAITS[type_]
    ne0 = rows.shape[-1] // tt.type_size * tt.block_size
    blocks = np.ascontiguousarray(rows).reshape(-1, tt.type_size)
    return DEQUANTIZE[type_](blocks).reshape(*rows.shape[:-1], ne0)
