"""The kernels the launchers pick for real SD shapes compile for an H200 (sm_90) without spilling more
than a few bytes: the compiler's view, which the interpreter that runs the other kernel tests lacks
(gpu_compile.py, in a subprocess because TRITON_INTERPRET must be unset before Triton is imported)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _toolchain():
    try:
        import triton
    except Exception:  # noqa: BLE001 - no (working) Triton: nothing to compile with
        return None
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return bin_dir if os.path.exists(os.path.join(bin_dir, "ptxas")) else None


@pytest.fixture(scope="module")
def compiled():
    if _toolchain() is None:
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(HERE, "gpu_compile.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_sm90(compiled):
    names = {k["kernel"] for k in compiled}
    assert names >= {"_gn_group_kernel", "_gn_stats_kernel", "_gn_apply_kernel", "_bias_residual_add_kernel",
                     "_add_layer_norm_kernel", "_layer_norm_kernel"}, names
    assert len(compiled) >= 20


def test_no_real_spills(compiled):
    """A few bytes of stack (ptxas spills 20-32 B at 128 registers for a channels_last group of 40 channels
    x 16²) cost little; a tile too big for its warps spills hundreds."""
    big = [k for k in compiled if k.get("stack", 0) > 64 or k.get("local", 0) > 0]
    assert not big, big
