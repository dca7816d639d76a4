"""Makes the repo importable as the package `sd_accel` without running its ComfyUI entry point.

The repo root is a package whose real name is whatever folder the user cloned into; tests give it a
fixed name here so `import sd_accel.kernels.group_norm_silu` works from any checkout folder.
"""
import os
import shutil
import sys
import types

# CI has no GPU: Triton's CPU interpreter runs the kernels. It must be set before anything imports
# Triton, so it lives here rather than in single test files. On a machine with an NVIDIA driver (the
# GPU machine running tests/gpu) the kernels are compiled for the device instead.
if not shutil.which("nvidia-smi") and os.environ.get("SDACCEL_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)    # the shared helpers (comfy_inproc, tiny_models) for every layer's tests

if "sd_accel" not in sys.modules:
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    pkg.__file__ = os.path.join(REPO, "__init__.py")
    sys.modules["sd_accel"] = pkg
