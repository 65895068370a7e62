"""Which ggml-cpu build the kernels reproduce, and with how many threads.

ggml-cpu's float results depend on the instruction set it was compiled for (README, "Which llama.cpp
build we match"): an AVX2 build keeps float dot products, soft-max, SiLU and NORM's variance in 8
lanes, an AVX-512 build in 16, with other reduction trees, another vector exp and, with AVX512_BF16,
BF16 pair products. Split-KV attention cuts the KV into one slice per ggml thread. A Target names one
such build; every Node carries one, and the kernels take their lane width and thread count from it.

`lanes` and `bf16_pairs` are plain values passed into the numba kernels at run time, so one compiled
kernel serves every target (and the worker's warm-up compiles them all).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Target:
    name: str = "avx2"
    lanes: int = 8  # float SIMD width of the build: 8 (AVX2) or 16 (AVX-512)
    bf16_pairs: bool = False  # AVX512_BF16: BF16 dots accumulate pairs with VDPBF16PS
    threads: int = max(1, (os.cpu_count() or 2) // 2)  # ggml's thread count (llama.cpp's worker -t)

    def with_threads(self, threads: int) -> "Target":
        return replace(self, threads=max(1, int(threads)))


AVX2 = Target()
# AVX512F/DQ/BW/VL + AVX512_BF16, as -march=native gives on AMD Zen 4 and Intel Cooper Lake
AVX512 = Target("avx512", 16, True)
# AVX-512 without BF16 (Intel Skylake-SP, Ice Lake): BF16 dots multiply and add in 16 lanes
AVX512_NO_BF16 = Target("avx512-nobf16", 16, False)
TARGETS = {t.name: t for t in (AVX2, AVX512, AVX512_NO_BF16)}


def host_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# What a -march=native build of ggml-cpu takes from each CPU flag for the float orders we reproduce:
# (/proc/cpuinfo flag, the compiler macro it turns on, the ggml-cpu source whose #if tests it, what it
# selects there). Quantized dot products use AVX512_VNNI/VBMI too, but in integers: same result either way.
GGML_FEATURES = (
    ("avx512f", "__AVX512F__", "simd-mappings.h",
     "16-lane F32 vectors; F16 and F32 dots in 16 lanes (GGML_F32x16, GGML_F32Cx16)"),
    ("avx512dq", "__AVX512DQ__", "vec.cpp",
     "with AVX512F: 16-lane soft-max exp, SiLU and NORM's sums (ggml_v_expf/ggml_v_silu of __m512)"),
    ("avx512_bf16", "__AVX512BF16__", "vec.cpp", "BF16 dots as VDPBF16PS pair products"),
    ("avx512_fp16", "__AVX512FP16__", "simd-mappings.h",
     "F16 dots keep F32x16 accumulation (GGML_F16_DOT_*); GGML_F16_VEC turns half precision, 128 a step"),
)


def detect(flags: set[str] | None = None) -> Target:
    """The build a plain `cmake` (GGML_NATIVE, -march=native) of llama.cpp makes on this host.

    ggml's 16-lane soft-max/SiLU/norm sums need AVX512F and AVX512DQ, its BF16 pair products
    AVX512_BF16 (GGML_FEATURES). AVX512_FP16 (Sapphire Rapids, Granite Rapids) leaves the orders
    we model as they are: ggml's F16 dot products accumulate in F32x16 there exactly as on any
    AVX-512 build. What it does change is ggml_vec_mad_f16/ggml_vec_scale_f16, the F16-V update of
    flash attention's per-row path: in steps of 128 elements they multiply and add in half
    precision (the factor rounded to F16 first), so for a V head of 128 or more a native build
    there differs from every target here; below 128 all of it is the scalar leftover loop.
    """
    flags = host_flags() if flags is None else flags
    if {"avx512f", "avx512dq"} <= flags:
        return AVX512 if "avx512_bf16" in flags else AVX512_NO_BF16
    return AVX2


def resolve(name: str) -> Target:
    """'auto' or one of TARGETS' names."""
    if name == "auto":
        return detect()
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown ISA {name!r} (auto, {', '.join(TARGETS)})") from None
