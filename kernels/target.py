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


def detect(flags: set[str] | None = None) -> Target:
    """The build a plain `cmake` (GGML_NATIVE, -march=native) of llama.cpp makes on this host.

    ggml's 16-lane soft-max/SiLU need AVX512F and AVX512DQ; AVX512_FP16 (Sapphire Rapids) would make
    ggml compute F16 dots in half precision, which no target here reproduces: such a host gets AVX2's
    orders and should run the reference built with GGML_NATIVE=OFF.
    """
    flags = host_flags() if flags is None else flags
    if {"avx512f", "avx512dq"} <= flags and "avx512_fp16" not in flags:
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
