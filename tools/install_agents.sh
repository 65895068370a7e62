#!/usr/bin/env bash
# Install the pi coding agent (npm @mariozechner/pi-coding-agent, pinned) for tests/interop/test_agents.py.
# Idempotent: a no-op (no network) once that version is in the cache directory. Prints pi's path.
set -euo pipefail
PI_VERSION="${PI_VERSION:-0.73.1}"
PREFIX="${PI_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/pyrpc-agents/pi-$PI_VERSION}"
PI="$PREFIX/node_modules/.bin/pi"
if ! command -v npm >/dev/null; then
  echo "install_agents.sh: npm is needed (Node.js >= 20.6) to install pi" >&2
  exit 1
fi
installed() { [ -x "$PI" ] && [ "$(node -p "require('$PREFIX/node_modules/@mariozechner/pi-coding-agent/package.json').version" 2>/dev/null)" = "$PI_VERSION" ]; }
if ! installed; then
  mkdir -p "$PREFIX"
  npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error "@mariozechner/pi-coding-agent@$PI_VERSION" >&2
  installed
fi
echo "$PI"
