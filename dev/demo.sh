#!/usr/bin/env bash
# README command (a): one accelerated generation through a real ComfyUI (dev/demo.py; --help for its options:
# --ckpt FILE, your checkpoint; --comfyui DIR, your ComfyUI; --size, --steps, --seed). It checks the
# arguments, prepares $SDACCEL_HOME with dev/setup_env.sh, then runs there; the image lands in the current
# folder. Run from any folder: relative paths in the arguments are yours.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/demo.py" "$@"
