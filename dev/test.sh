#!/usr/bin/env bash
# README command (b): prepare the environment, then run the whole test suite (kernels, engine, a real
# ComfyUI server, the browser). SDACCEL_COMFYUI=<checkout> runs it against another ComfyUI (e.g. the current one).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash dev/setup_env.sh | tail -n 1)
bash dev/setup_chromium.sh   # never fails: without Chromium the browser tests say why they cannot run
export OMP_NUM_THREADS=1
# no path: pyproject's testpaths (tests/); paths given (bash dev/test.sh tests/dev) run only those
exec "$VPY" -m pytest -q "$@"
