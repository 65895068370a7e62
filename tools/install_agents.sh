#!/usr/bin/env bash
# Install the coding agents tests/interop/test_agents.py runs, each pinned, from npm: pi
# (@mariozechner/pi-coding-agent) and opencode (opencode-ai, a prebuilt binary per platform).
# Idempotent: a no-op (no network) once those versions are in the cache directory.
# Prints one line per agent: its name and its executable's path.
set -euo pipefail
PI_VERSION="${PI_VERSION:-0.73.1}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/pyrpc-agents"
if ! command -v npm >/dev/null; then
  echo "install_agents.sh: npm is needed (Node.js >= 20.6) to install the agents" >&2
  exit 1
fi

# version_of PREFIX PACKAGE: the version npm installed there (empty if none)
version_of() { node -p "require('$1/node_modules/$2/package.json').version" 2>/dev/null || true; }

# install NAME PACKAGE VERSION BIN: npm-install PACKAGE@VERSION into its own prefix unless it is there
install() {
  local name="$1" package="$2" version="$3" bin="$4"
  local prefix="$CACHE/$name-$version"
  if ! [ -x "$prefix/node_modules/.bin/$bin" ] || [ "$(version_of "$prefix" "$package")" != "$version" ]; then
    mkdir -p "$prefix"
    npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error "$package@$version" >&2
    [ "$(version_of "$prefix" "$package")" = "$version" ]
  fi
  echo "$name $prefix/node_modules/.bin/$bin"
}

install pi @mariozechner/pi-coding-agent "$PI_VERSION" pi
install opencode opencode-ai "$OPENCODE_VERSION" opencode
