"""--isa auto picks the ggml-cpu build a native llama.cpp build on the host would be (kernels.target)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.target import AVX2, AVX512, AVX512_NO_BF16, GGML_FEATURES, TARGETS, detect, host_flags, resolve
from tools.reference import llama_source_dir

pytestmark = pytest.mark.unit

# /proc/cpuinfo flags of these CPUs (the AVX/AVX-512 part; the rest changes nothing here)
AVX2_HOST = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # Zen 1-3, Haswell..Raptor Lake
AVX512_BASE = AVX2_HOST | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
SKYLAKE_SP = AVX512_BASE
ICE_LAKE = AVX512_BASE | {"avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
                          "avx512_vpopcntdq", "gfni", "vaes", "vpclmulqdq"}
COOPER_LAKE = AVX512_BASE | {"avx512_vnni", "avx512_bf16"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
ZEN5 = ZEN4 | {"avx512_vp2intersect", "avx_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "serialize"}
GRANITE_RAPIDS = SAPPHIRE_RAPIDS | {"amx_fp16", "prefetchiti"}
KNIGHTS_LANDING = AVX2_HOST | {"avx512f", "avx512cd", "avx512er", "avx512pf"}  # no AVX512DQ


@pytest.mark.parametrize("flags, expected", [
    (AVX2_HOST, AVX2),
    (KNIGHTS_LANDING, AVX2),  # ggml's 16-lane soft-max/SiLU also need AVX512DQ
    (SKYLAKE_SP, AVX512_NO_BF16),
    (ICE_LAKE, AVX512_NO_BF16),  # VNNI/VBMI only touch integer (quantized) dots
    (COOPER_LAKE, AVX512),
    (ZEN4, AVX512),
    (ZEN5, AVX512),
    (SAPPHIRE_RAPIDS, AVX512),  # AVX512_FP16: F16 dots still accumulate in F32x16 (measured: 4/4 texts)
    (GRANITE_RAPIDS, AVX512),
    (set(), AVX2),
])
def test_detect_follows_the_cpu_flags(flags, expected):
    assert detect(flags) == expected


def test_detect_uses_only_flags_the_feature_table_names():
    """Every flag detect() reads is in GGML_FEATURES, and every one of those flips the answer on some host."""
    table_flags = {flag for flag, *_ in GGML_FEATURES}
    for host in (SKYLAKE_SP, ZEN4, SAPPHIRE_RAPIDS):
        for flag in host - table_flags:
            assert detect(host - {flag}) == detect(host), flag
    assert detect(ZEN4 - {"avx512f"}) == AVX2 and detect(ZEN4 - {"avx512dq"}) == AVX2
    assert detect(ZEN4 - {"avx512_bf16"}) == AVX512_NO_BF16
    assert detect(SAPPHIRE_RAPIDS - {"avx512_fp16"}) == detect(SAPPHIRE_RAPIDS)  # fp16 changes no order we model


# --- the rule against the pinned ggml-cpu sources -------------------------------------------------

def _ggml_cpu_dir() -> Path:
    d = llama_source_dir() / "ggml" / "src" / "ggml-cpu"
    if not d.is_dir():
        pytest.skip(f"pinned llama.cpp sources not extracted at {d} (bash tools/install_reference.sh)")
    return d


def _conditions(text: str) -> list[str]:
    """The conditions of every #if/#elif/#ifdef in a C source, continuation lines joined."""
    text = text.replace("\\\n", " ")
    return [m.group(2) for m in re.finditer(r"^\s*#\s*(if|elif|ifdef)\b(.*)$", text, re.M)]


def _block(text: str, condition: str) -> str:
    """The text under the first `#if <condition>` up to its #else/#elif/#endif at the same depth."""
    start = re.search(r"^\s*#\s*if\s+" + re.escape(condition) + r"\s*$", text, re.M)
    assert start, condition
    depth, out = 0, []
    for line in text[start.end():].splitlines():
        d = re.match(r"\s*#\s*(\w+)", line)
        if d and d.group(1) in ("if", "ifdef", "ifndef"):
            depth += 1
        elif d and d.group(1) in ("else", "elif", "endif"):
            if depth == 0:
                break
            depth -= d.group(1) == "endif"
        out.append(line)
    return "\n".join(out)


def test_feature_table_names_macros_the_sources_test():
    d = _ggml_cpu_dir()
    for flag, macro, source, _ in GGML_FEATURES:
        conds = _conditions((d / source).read_text())
        assert any(f"defined({macro})" in c or c.strip() == macro for c in conds), (flag, macro, source)


def test_sources_select_the_paths_the_rule_assumes():
    d = _ggml_cpu_dir()
    vec_cpp, vec_h = (d / "vec.cpp").read_text(), (d / "vec.h").read_text()
    simd = (d / "simd-mappings.h").read_text()
    both = "defined(__AVX512F__) && defined(__AVX512DQ__)"
    # soft-max's exp, SiLU and the norm sums take 16 lanes only with AVX512F *and* AVX512DQ
    assert sum(both in c for c in _conditions(vec_cpp)) >= 3
    assert any(both in c for c in _conditions(vec_h))  # ggml_v_expf / ggml_v_silu of __m512
    assert "__m512 ggml_v_expf" in vec_h and "__m512 ggml_v_silu" in vec_h
    # BF16 dots: VDPBF16PS under AVX512BF16, else plain AVX512F
    bf16 = _block(vec_cpp, "defined(__AVX512BF16__)")
    assert "_mm512_dpbf16_ps" in bf16
    # AVX512FP16: F16 dots keep F32x16 accumulation, the same order as the AVX512F build without it
    fp16_dot = _block(simd, "defined(__AVX512FP16__)")  # the first one: GGML_F16 vectors in half precision
    assert "_mm512_fmadd_ph" in fp16_dot
    dot = simd[simd.index("GGML_F16_DOT_"):]
    dot_fp16 = _block(dot, "defined(__AVX512FP16__)")
    assert re.search(r"#define GGML_F16_DOT_VEC\s+GGML_F32x16\b", dot_fp16)
    assert re.search(r"#define GGML_F16_DOT_VEC_FMA\s+GGML_F32x16_FMA\b", dot_fp16)
    assert re.search(r"#define GGML_F16_DOT_VEC_REDUCE\s+GGML_F32x16_REDUCE\b", dot_fp16)
    # ... with the same step as the non-FP16 F16 vectors (4 registers of 16 lanes) and the same reduce tree
    assert re.search(r"#define GGML_F16_DOT_STEP\s+GGML_F32_STEP\b", dot_fp16)
    avx512 = simd[simd.index("#elif defined(__AVX512F__)"):]
    avx512 = avx512[:avx512.index("#elif defined(__AVX__)")]  # ggml's AVX-512 GGML_SIMD section

    def define(text, name):
        return int(re.search(rf"#define {name}\s+(\d+)", text).group(1))

    f16_fallback = avx512[avx512.index("#else // Fallback FP16"):]
    assert (define(avx512, "GGML_F32_STEP"), define(avx512, "GGML_F32_EPR")) == (64, 16)
    assert (define(f16_fallback, "GGML_F16_STEP"), define(f16_fallback, "GGML_F16_EPR")) == (64, 16)
    reduce = {name: " ".join(re.search(rf"#define {name}\(res, x\)(.*?)while \(0\)", simd, re.S).group(1).split())
              for name in ("GGML_F32x16_REDUCE", "GGML_F32Cx16_REDUCE")}
    assert reduce["GGML_F32x16_REDUCE"] == reduce["GGML_F32Cx16_REDUCE"]
    dot_f16 = vec_cpp[vec_cpp.index("void ggml_vec_dot_f16("):vec_cpp.index("void ggml_vec_silu_f32(")]
    assert "GGML_F16_DOT_VEC_FMA" in dot_f16 and "GGML_F16_VEC_FMA" not in dot_f16
    # what AVX512FP16 does change (detect's docstring): the F16-V update in half precision, 128 at a step
    half = _block(avx512, "defined(__AVX512FP16__)")
    assert define(half, "GGML_F16_STEP") == 128 and "_mm512_set1_ph" in half
    for fn in ("ggml_vec_mad_f16", "ggml_vec_scale_f16"):
        body = vec_h[vec_h.index(f"inline static void {fn}("):]
        body = body[:body.index("\n}\n")]
        assert "GGML_F16_VEC_SET1(v)" in body and "n & ~(GGML_F16_STEP - 1)" in body, fn


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
