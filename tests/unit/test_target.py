"""--isa auto picks the ggml-cpu build a native llama.cpp build on the host would be (kernels.target)."""
from __future__ import annotations

import pytest

from kernels.target import AVX2, AVX512, AVX512_NO_BF16, TARGETS, detect, host_flags, resolve

pytestmark = pytest.mark.unit

ZEN4 = {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SKYLAKE_SP = {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512cd"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile"}


@pytest.mark.parametrize("flags, expected", [
    ({"sse4_2", "avx", "avx2", "fma", "f16c"}, AVX2),  # Zen 1-3, Haswell..Comet Lake
    ({"avx2", "avx512f"}, AVX2),  # ggml's 16-lane soft-max/SiLU also need AVX512DQ
    (SKYLAKE_SP, AVX512_NO_BF16),
    (ZEN4, AVX512),
    (SAPPHIRE_RAPIDS, AVX2),  # AVX512_FP16: F16 dots in half precision, which no target reproduces
    (set(), AVX2),
])
def test_detect_follows_the_cpu_flags(flags, expected):
    assert detect(flags) == expected


def test_resolve_names_and_auto():
    assert resolve("auto") == detect(host_flags())
    for name, target in TARGETS.items():
        assert resolve(name) is target and target.name == name
    with pytest.raises(ValueError, match="unknown ISA"):
        resolve("avx10")


def test_host_flags_of_a_missing_file_are_empty(tmp_path):
    assert host_flags(str(tmp_path / "cpuinfo")) == set()
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert host_flags(str(tmp_path / "cpuinfo")) == {"fpu", "avx2", "avx512f"}


def test_threads_travel_with_the_target():
    assert AVX512.with_threads(3).threads == 3 and AVX512.with_threads(3).lanes == 16
    assert AVX2.with_threads(0).threads == 1
