#!/usr/bin/env bash
# Test set-up only (dev/test.sh runs it; the demo never does): Debian's Chromium for tests/browser, driven by
# the playwright package that dev/setup_env.sh puts in the venv (no `playwright install`: the system browser
# is used). The one step that touches the system, so it needs root (or sudo without a password) and apt-get.
# Never fails: without Chromium the browser tests say why they cannot run (tests/browser/conftest.py: skipped,
# or failed where SDACCEL_REQUIRE_BROWSER=1, as in .ci/run), and every other test still runs.
# It waits up to a minute for a dpkg lock that another apt is holding.
set -uo pipefail
CHROMIUM="${SDACCEL_CHROMIUM:-/usr/bin/chromium}"
LOG="${SDACCEL_HOME:-$HOME/.cache/sd_accel}/chromium-install.log"
log() { echo "[setup] $*" >&2; }

[ -x "$CHROMIUM" ] && exit 0
if [ "$(id -u)" = 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"   # -n: never stop the tests at a password prompt
else
  log "no Chromium at $CHROMIUM and not root: the browser tests cannot run (install chromium yourself to run them)"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  log "no Chromium at $CHROMIUM and no apt-get: the browser tests cannot run (install Chromium, or set SDACCEL_CHROMIUM)"
  exit 0
fi

log "installing chromium for the browser tests (apt-get, about a minute; output in $LOG)"
mkdir -p "$(dirname "$LOG")"
# env: sudo resets the environment, so the variable is set on apt-get's side of it
if $SUDO apt-get -o DPkg::Lock::Timeout=60 update -qq > "$LOG" 2>&1 &&
   $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=60 install -y -qq chromium >> "$LOG" 2>&1; then
  if [ -x "$CHROMIUM" ]; then
    log "chromium installed"
  else
    log "apt-get installed chromium, but there is none at $CHROMIUM: the browser tests cannot run (set SDACCEL_CHROMIUM)"
  fi
else
  why=$(grep -E '^(E|W):' "$LOG" | tail -n 1)
  log "could not install chromium (${why:-see the log}); the browser tests cannot run. Full output: $LOG"
fi
exit 0
