"""bench/step_cache_error.py in a subprocess on the CPU (a real ComfyUI, a random small SD1.5 UNet, 4 steps): one
record per weights kind, each with the error of every output block a cached call runs, the whole UNet's and the
final latent's, all computed (finite, above zero); ComfyUI 2024 is refused with its reason."""
import json
import math
import os
import subprocess
import sys

import comfy_inproc

SCRIPT = os.path.join(comfy_inproc.REPO, "bench", "step_cache_error.py")


def _has_keyed_wrappers():
    comfy_inproc.fixtures_module()
    import comfy.model_patcher
    return hasattr(comfy.model_patcher.ModelPatcher, "add_wrapper_with_key")


def test_records_per_block_whole_unet_and_final_latent_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, SCRIPT, "--comfy-dir", comfy_inproc.COMFY, "--out", str(tmp_path),
                           "--work", str(tmp_path), "--steps", "4", "--size", "64", "--modes", "interval 2",
                           "--branches", "1"], env=env, capture_output=True, text=True, timeout=500)
    if not _has_keyed_wrappers():
        assert proc.returncode != 0 and "ComfyUI 2024" in proc.stderr + proc.stdout
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(str(tmp_path / "results.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert [r["config"] for r in recs] == ["stepcache_error_random_interval2_b1", "stepcache_error_outliers_interval2_b1"]
    for r in recs:
        assert r["cached_steps"] == 2, r        # steps 1 and 3 of 0..3
        # the small preset has 4 output blocks: branch 1 runs output blocks 2 and 3 on cached steps
        assert sorted(r["block_rel_err"]) == ["output 2", "output 3"], r["block_rel_err"]
        values = list(r["block_rel_err"].values()) + [r["unet_rel_err_mean"], r["unet_rel_err_max"],
                                                      r["final_latent_rel_err"]]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert r["unet_rel_err_max"] >= r["unet_rel_err_mean"]
    assert recs[0]["unet_rel_err_mean"] != recs[1]["unet_rel_err_mean"], "the outlier channels changed nothing"
