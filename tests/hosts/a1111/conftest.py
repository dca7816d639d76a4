"""A1111 and Forge host tests: the real ldm UNet (PyPI's stable-diffusion-sdkit), a stand-in of A1111's API
(`fake_a1111`, which Forge keeps) and one of Forge's backend (`fake_forge`, see fake_forge/README.md).

`fake_a1111` puts tests/hosts/a1111/fake_a1111 first on sys.path so `import modules` is the stand-in, with
fresh state per test; `unet_util.load_extension_script` loads `scripts/sd_accel.py` the way A1111
does. The ldm UNet comes from `stable-diffusion-sdkit==2.1.5` (installed `--no-deps`, with omegaconf,
by dev/setup_env.sh).
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_a1111")
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _purge_modules():
    for name in [n for n in sys.modules if n == "modules" or n.startswith("modules.")]:
        del sys.modules[name]


@pytest.fixture
def fake_a1111():
    _purge_modules()
    sys.path.insert(0, FAKE)
    try:
        import modules.script_callbacks  # noqa: F401
        yield sys.modules["modules"]
    finally:
        sys.path.remove(FAKE)
        _purge_modules()


def _set_interpreter(monkeypatch, on):
    for name, mod in list(sys.modules.items()):
        if name.endswith("kernels._triton") and hasattr(mod, "interpret_mode"):
            monkeypatch.setattr(mod, "interpret_mode", lambda: on)


@pytest.fixture
def stock_kernels(monkeypatch):
    """Kernels take their torch reference path (Triton's interpreter costs ~0.5 s per GroupNorm):
    for tests about swapping, settings and reloads rather than the kernels themselves."""
    import sd_accel.kernels._triton  # noqa: F401
    _set_interpreter(monkeypatch, False)
    yield lambda: _set_interpreter(monkeypatch, False)   # again once the extension's package is loaded


@pytest.fixture
def fake_forge():
    """Forge's backend stand-in (fake_forge/backend) importable as `backend`, and `modules_forge` imported
    (how the extension tells it runs in Forge)."""
    import forge_util
    forge_util.purge()
    sys.path.insert(0, forge_util.FAKE_FORGE)
    try:
        import modules_forge  # noqa: F401
        from backend import memory_management
        memory_management.loaded.clear()
        yield sys.modules["backend"]
    finally:
        sys.path.remove(forge_util.FAKE_FORGE)
        forge_util.purge()
