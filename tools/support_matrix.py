"""The worker's support matrix (op x types), generated from the kernel table and kept in docs/worker.md.

    python tools/support_matrix.py            # print the table
    python tools/support_matrix.py --write    # replace the table between the markers in docs/worker.md
    python tools/support_matrix.py --check    # exit 1 if the table in docs/worker.md is stale

Nothing here knows what a kernel supports: every registered kernel's own `check(node)` is asked about
small synthetic nodes, one per combination of types in its slots (weights, activations, indices,
result), and the combinations it accepts are what the table shows. The graph layer runs the same
`check` on every node a client sends, so a node outside the table is refused before anything runs.
A kernel registered without a probe below is an error, so the table cannot silently miss an op.
"""
from __future__ import annotations

import argparse
import itertools
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import InvalidNode, Node, Tensor, load_all  # noqa: E402
from kernels.registry import KERNELS, op_label  # noqa: E402
from wire.ggml import TYPE_TRAITS, GGMLOp, GGMLType  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "worker.md"
BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"

T = GGMLType
ALL = tuple(t for t in T if t in TYPE_TRAITS and TYPE_TRAITS[t].block_size > 0)  # every real ggml type
PLAIN = tuple(t for t in ALL if not TYPE_TRAITS[t].is_quantized)  # F32, F16, BF16, I8..I64, F64
ROW = 256  # a row length every block size divides
NONE = "none"  # an optional source left out


def _f32(*values: float) -> list[int]:
    return list(struct.unpack(f"<{len(values)}i", struct.pack(f"<{len(values)}f", *values)))


_tensors: dict = {}


def tensor(type_: T | str, *ne: int) -> Tensor | None:
    """A contiguous tensor of that type and shape (cached: checks only read shapes and strides)."""
    if type_ == NONE:
        return None
    key = (type_, ne)
    if key not in _tensors:
        _tensors[key] = Tensor.new(type_, ne)
    return _tensors[key]


@dataclass(frozen=True)
class Probe:
    slots: tuple[tuple[str, tuple], ...]  # (slot name, candidate types), in the order build takes them
    build: Callable[..., Node]  # (op, sub-op, *types) -> a node whose shapes suit the op
    template: str  # how one accepted combination reads, e.g. "{src0} x {src1} -> {dst}"


def _mul_mat(op, sub, w, x, y):
    return Node(op, tensor(y, 4, 3), [tensor(w, ROW, 4), tensor(x, ROW, 3)])


def _mul_mat_id(op, sub, w, x, i, y):
    return Node(op, tensor(y, 4, 2, 3), [tensor(w, ROW, 4, 3), tensor(x, ROW, 1, 3), tensor(i, 2, 3)])


def _get_rows(op, sub, w, i, y):
    return Node(op, tensor(y, ROW, 3), [tensor(w, ROW, 4), tensor(i, 3)])


def _copy(op, sub, x, y):
    dst = tensor(y, ROW, 4)
    return Node(op, dst, [tensor(x, ROW, 4), dst] if op == GGMLOp.CPY else [tensor(x, ROW, 4)])


def _set_rows(op, sub, x, i, y):
    dst = tensor(y, ROW, 8)
    return Node(op, dst, [tensor(x, ROW, 3), tensor(i, 3), dst])


def _binary(op, sub, a, b, y):
    return Node(op, tensor(y, ROW, 4), [tensor(a, ROW, 4), tensor(b, ROW, 4)])


def _unary(op, sub, x, y):
    params = (_f32(1.0, 0.0) if op == GGMLOp.SCALE else _f32(-1.0, 1.0) if op == GGMLOp.CLAMP
              else _f32(1e-6) if op in _NORMS else [sub])
    return Node(op, tensor(y, ROW, 4), [tensor(x, ROW, 4)], params)


def _glu(op, sub, x, y):
    return Node(op, tensor(y, ROW, 4), [tensor(x, 2 * ROW, 4)], [sub, 0])


def _soft_max(op, sub, x, m, y):
    return Node(op, tensor(y, ROW, 4), [tensor(x, ROW, 4), tensor(m, ROW, 4)], _f32(1.0, 0.0))


def _rope(op, sub, x, p, y):
    params = [0, 64, 0, 0, 4096] + _f32(10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    return Node(op, tensor(y, 64, 2, 3), [tensor(x, 64, 2, 3), tensor(p, 3)], params)


def _flash_attn(op, sub, q, k, v, m, y):
    head, n_q, n_kv = 64, 3, 32
    srcs = [tensor(q, head, n_q, 4), tensor(k, head, n_kv, 2), tensor(v, head, n_kv, 2), tensor(m, n_kv, n_q)]
    return Node(op, tensor(y, head, 4, n_q), srcs, _f32(0.125))


def _concat(op, sub, a, b, y):
    return Node(op, tensor(y, ROW, 8), [tensor(a, ROW, 4), tensor(b, ROW, 4)], [1])


def _repeat(op, sub, x, y):
    return Node(op, tensor(y, ROW, 4), [tensor(x, ROW, 2)])


def _argmax(op, sub, x, y):
    return Node(op, tensor(y, 4), [tensor(x, ROW, 4)])


def _sort(op, sub, x, y):  # ARGSORT (descending) and TOP_K
    return Node(op, tensor(y, ROW if op == GGMLOp.ARGSORT else 8, 4), [tensor(x, ROW, 4)], [1])


def _add_id(op, sub, a, b, ids, y):
    return Node(op, tensor(y, ROW, 2, 3), [tensor(a, ROW, 2, 3), tensor(b, ROW, 8), tensor(ids, 2, 3)])


def _sum_rows(op, sub, x, y):
    return Node(op, tensor(y, 1, 4), [tensor(x, ROW, 4)])


_NORMS = (GGMLOp.NORM, GGMLOp.RMS_NORM, GGMLOp.L2_NORM)
_ONE_IN_ONE_OUT = Probe((("src", PLAIN), ("dst", PLAIN)), _unary, "{src} → {dst}")
_BINARY = Probe((("src0", ALL), ("src1", PLAIN), ("dst", ALL)), _binary, "{src0}, {src1} → {dst}")
_COPY = Probe((("src", ALL), ("dst", ALL)), _copy, "{src} → {dst}")

PROBES: dict[int, Probe] = {
    GGMLOp.MUL_MAT: Probe((("weights", ALL), ("activations", PLAIN), ("dst", PLAIN)), _mul_mat,
                          "{weights} × {activations} → {dst}"),
    GGMLOp.MUL_MAT_ID: Probe((("weights", ALL), ("activations", PLAIN), ("ids", PLAIN), ("dst", PLAIN)),
                             _mul_mat_id, "{weights} × {activations}, experts by {ids} → {dst}"),
    GGMLOp.GET_ROWS: Probe((("src", ALL), ("index", PLAIN), ("dst", PLAIN)), _get_rows,
                           "{src} rows by {index} → {dst}"),
    GGMLOp.SET_ROWS: Probe((("values", PLAIN), ("index", PLAIN), ("dst", ALL)), _set_rows,
                           "{values} rows by {index} → {dst}"),
    GGMLOp.DUP: _COPY, GGMLOp.CPY: _COPY, GGMLOp.CONT: _COPY,
    GGMLOp.ADD: _BINARY, GGMLOp.SUB: _BINARY, GGMLOp.MUL: _BINARY, GGMLOp.DIV: _BINARY,
    GGMLOp.UNARY: _ONE_IN_ONE_OUT, GGMLOp.SQR: _ONE_IN_ONE_OUT, GGMLOp.SQRT: _ONE_IN_ONE_OUT,
    GGMLOp.SCALE: _ONE_IN_ONE_OUT, GGMLOp.NORM: _ONE_IN_ONE_OUT, GGMLOp.RMS_NORM: _ONE_IN_ONE_OUT,
    GGMLOp.L2_NORM: _ONE_IN_ONE_OUT, GGMLOp.CLAMP: _ONE_IN_ONE_OUT,
    GGMLOp.ADD_ID: Probe((("src0", PLAIN), ("src1", PLAIN), ("ids", PLAIN), ("dst", PLAIN)), _add_id,
                         "{src0}, {src1} rows by {ids} → {dst}"),
    GGMLOp.SUM_ROWS: Probe((("src", PLAIN), ("dst", PLAIN)), _sum_rows, "{src} → {dst}"),
    GGMLOp.ARGSORT: Probe((("src", PLAIN), ("dst", PLAIN)), _sort, "{src} → {dst}"),
    GGMLOp.TOP_K: Probe((("src", PLAIN), ("dst", PLAIN)), _sort, "{src} → {dst}"),
    GGMLOp.GLU: Probe((("src", PLAIN), ("dst", PLAIN)), _glu, "{src} → {dst}"),
    GGMLOp.SOFT_MAX: Probe((("src", PLAIN), ("mask", (NONE,) + PLAIN), ("dst", PLAIN)), _soft_max,
                           "{src}, mask {mask} → {dst}"),
    GGMLOp.ROPE: Probe((("src", PLAIN), ("positions", PLAIN), ("dst", PLAIN)), _rope,
                       "{src}, positions {positions} → {dst}"),
    GGMLOp.FLASH_ATTN_EXT: Probe((("q", (T.F32, T.F16, T.BF16)), ("k", ALL), ("v", ALL), ("mask", (NONE, T.F16, T.F32)),
                                  ("dst", (T.F32, T.F16))), _flash_attn,
                                 "Q {q}, K {k}, V {v}, mask {mask} → {dst}"),
    GGMLOp.CONCAT: Probe((("src", ALL), ("src1", ALL), ("dst", ALL)), _concat, "{src}, {src1} → {dst}"),
    GGMLOp.REPEAT: Probe((("src", ALL), ("dst", ALL)), _repeat, "{src} → {dst}"),
    GGMLOp.ARGMAX: Probe((("src", PLAIN), ("dst", PLAIN)), _argmax, "{src} → {dst}"),
}


def accepted(op: int, sub: int) -> set[tuple]:
    """Every combination of slot types the registered kernel's check lets through."""
    probe = PROBES.get(op)
    if probe is None:
        raise SystemExit(f"support_matrix: no probe for {op_label(op, sub)}; add one to PROBES")
    check = KERNELS[(op, sub)].check
    ok = set()
    for types in itertools.product(*(candidates for _, candidates in probe.slots)):
        try:
            check(probe.build(GGMLOp(op), sub, *types))
        except InvalidNode:
            continue
        ok.add(types)
    return ok


# --- rendering --------------------------------------------------------------------------------

# floats first, then integers, then block types in ggml's order
DISPLAY_ORDER = {t: i for i, t in enumerate(
    (NONE, T.F32, T.F16, T.BF16, T.F64, T.I8, T.I16, T.I32, T.I64) + tuple(t for t in ALL if t not in PLAIN))}


def _names(values) -> str:
    return "/".join(v if isinstance(v, str) else v.name for v in sorted(values, key=DISPLAY_ORDER.__getitem__))


def describe(probe: Probe, combos: set[tuple]) -> list[str]:
    """Accepted combinations as a few readable lines, e.g. "F32/F16 → F32" for four combinations."""
    names = [name for name, _ in probe.slots]
    lines = []
    same = {c[0] for c in combos if len(set(c)) == 1}
    if len(same) >= 3:  # e.g. copies of any type into itself: one line, not one per type
        lines.append(probe.template.format(**dict.fromkeys(names, "X")) + f" for X in {_names(same)}")
        combos = {c for c in combos if len(set(c)) > 1}
    for merged in merge_products(combos):
        lines.append(probe.template.format(**{n: _names(v) for n, v in zip(names, merged)}))
    return sorted(lines, key=lambda l: (l.startswith("X"), l))


def merge_products(combos: set[tuple]) -> list[tuple[frozenset, ...]]:
    """Cover the combinations with few boxes (one set of types per slot): start from single combinations
    and keep joining two boxes that differ in one slot only."""
    boxes = {tuple(frozenset([v]) for v in c) for c in combos}
    merged = True
    while merged:
        merged = False
        for a, b in itertools.combinations(sorted(boxes, key=str), 2):
            differ = [i for i in range(len(a)) if a[i] != b[i]]
            if len(differ) == 1:
                i = differ[0]
                boxes -= {a, b}
                boxes.add(a[:i] + (a[i] | b[i],) + a[i + 1:])
                merged = True
                break
    return sorted(boxes, key=lambda box: [sorted(DISPLAY_ORDER[v] for v in s) for s in box])


def table() -> str:
    load_all()
    rows: dict[tuple, list[str]] = {}  # (lines) -> op labels sharing them
    for op, sub in sorted(KERNELS):
        combos = accepted(op, sub)  # first: it names an op that has no probe
        lines = describe(PROBES[op], combos)
        rows.setdefault(tuple(lines), []).append(op_label(op, sub))
    out = ["| op | types accepted (src → dst) |", "|---|---|"]
    for lines, labels in sorted(rows.items(), key=lambda item: min(_op_order(l) for l in item[1])):
        out.append(f"| {_labels(labels)} | {'<br>'.join(lines) or 'none'} |")
    return "\n".join(out)


def _op_order(label: str) -> int:
    return GGMLOp[label.split(":")[0]].value


def _labels(labels: list[str]) -> str:
    """'UNARY:ABS', 'UNARY:SGN' -> 'UNARY: ABS, SGN'."""
    plain = [l for l in labels if ":" not in l]
    families: dict[str, list[str]] = {}
    for l in labels:
        if ":" in l:
            family, sub = l.split(":")
            families.setdefault(family, []).append(sub)
    return ", ".join(plain + [f"{family}: {', '.join(subs)}" for family, subs in families.items()])


def readme_with(text: str, matrix: str) -> str:
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise SystemExit(f"support_matrix: {DOC} has no {BEGIN} ... {END} markers")
    return text[: start + len(BEGIN)] + "\n" + matrix + "\n" + text[stop:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update the table in docs/worker.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if the table in docs/worker.md is stale")
    args = parser.parse_args(argv)
    matrix = table()
    if not (args.write or args.check):
        print(matrix)
        return 0
    text = DOC.read_text(encoding="utf-8")
    updated = readme_with(text, matrix)
    if args.check:
        if updated != text:
            print(f"{DOC.name}: the support matrix is stale; run python tools/support_matrix.py --write",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
