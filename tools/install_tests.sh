#!/usr/bin/env bash
# Command 2's installs, what the tests need beyond the project: the test extras, the pinned llama.cpp
# reference (tools/install_reference.sh), the pi and opencode coding agents (install_agents.sh) and headless
# Chromium (install_browser.sh). The agents' and Chromium's are downloads and run beside the reference's build, which
# keeps both cores busy for ~9 minutes on a fresh machine; each prints its log if it fails.
set -euo pipefail
PYTHON="${PYTHON:-python}"
TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$TOOLS/.."
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT

bash "$TOOLS/install_agents.sh" >"$LOGS/agents.log" 2>&1 &
AGENTS=$!
bash "$TOOLS/install_browser.sh" >"$LOGS/browser.log" 2>&1 &
BROWSER=$!

"$PYTHON" -m pip install -e '.[test]'
bash "$TOOLS/install_reference.sh"

status=0
for job in "agents:$AGENTS" "browser:$BROWSER"; do
  name="${job%%:*}"
  if ! wait "${job##*:}"; then
    echo "install_$name.sh failed:" >&2
    cat "$LOGS/$name.log" >&2
    status=1
  fi
done
exit $status
