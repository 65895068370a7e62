"""The support matrix in docs/worker.md is generated from the kernel table and must not go stale or overstate."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from tool_modules import load_tool

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "support_matrix.py"


def test_documented_matrix_is_current():
    done = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr + done.stdout


def test_rendered_rows_cover_exactly_the_accepted_combinations():
    """Every line of the table expands to combinations the kernel's check accepts, and together they
    name all of them: merging into "A/B → C" lines never claims a pair that is refused."""
    tool = load_tool("support_matrix")
    tool.load_all()
    for op, sub in tool.KERNELS:
        combos = tool.accepted(op, sub)
        boxes = tool.merge_products(combos)
        covered = [c for box in boxes for c in itertools.product(*box)]
        assert sorted(covered, key=str) == sorted(combos, key=str), tool.op_label(op, sub)

