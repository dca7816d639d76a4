#!/usr/bin/env bash
# README command (b): prepare the environment, then run the whole test suite (kernels, engine, a real
# ComfyUI server). SDACCEL_COMFYUI=<checkout> runs it against another ComfyUI (e.g. the current one).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash dev/setup_env.sh | tail -n 1)
export OMP_NUM_THREADS=1
exec "$VPY" -m pytest tests -q "$@"
