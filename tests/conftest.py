"""Makes the repo importable as the package `sd_accel` without running its ComfyUI entry point.

The repo root is a package whose real name is whatever folder the user cloned into; tests give it a
fixed name here so `import sd_accel.kernels.group_norm_silu` works from any checkout folder.
"""
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if "sd_accel" not in sys.modules:
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    pkg.__file__ = os.path.join(REPO, "__init__.py")
    sys.modules["sd_accel"] = pkg
