"""bench/fp8_gemm_tma_trial.py --check on the CPU (Triton's interpreter): the trial TMA kernel, plain and persistent,
with and without GEGLU, at shapes with partial edge tiles, against the fp32 reference of the dequantized operands,
so a GPU run of the trial times a kernel that computes the right thing."""
import os
import subprocess
import sys

import comfy_inproc

SCRIPT = os.path.join(comfy_inproc.REPO, "bench", "fp8_gemm_tma_trial.py")


def test_the_trial_kernel_matches_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--check"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("check ok") == 2, proc.stdout
