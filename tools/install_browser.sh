#!/usr/bin/env bash
# Install Debian's headless Chromium and its chromedriver for tests/interop/test_web.py (selenium drives
# them; no browser is downloaded at test time). A no-op once both are on the PATH; installing needs root
# (or sudo) and apt-get.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
# the lock timeout: tools/install_tests.sh runs this beside install_reference.sh, whose AVX-512 build may apt-get too
APT=(apt-get -o DPkg::Lock::Timeout=600)
$SUDO "${APT[@]}" update -qq
DEBIAN_FRONTEND=noninteractive $SUDO "${APT[@]}" install -y -qq chromium chromium-driver >/dev/null
command -v chromium && command -v chromedriver
