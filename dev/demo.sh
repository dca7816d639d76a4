#!/usr/bin/env bash
# README command (a): prepare the environment, then one accelerated generation through a real ComfyUI.
# Options go to dev/demo.py: --ckpt FILE (your checkpoint), --comfyui DIR (your ComfyUI), --size, --steps.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash dev/setup_env.sh | tail -n 1)
exec "$VPY" dev/demo.py "$@"
