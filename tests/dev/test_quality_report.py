"""bench/quality.py, as a user runs it: a real ComfyUI in a subprocess on the CPU, a random tiny SD1.5 checkpoint
(dev/fixtures.py), two prompts at 64 px. The report's numbers are computed from the images: the reference rendered
again is identical (PSNR inf), the step cache moves the image by a finite PSNR and says LOSSY (current ComfyUI),
or is refused with its reason and changes nothing (ComfyUI 2024); metrics whose packages or weights are missing
say so in one line each."""
import json
import math
import os
import subprocess
import sys

import comfy_inproc

SCRIPT = os.path.join(comfy_inproc.REPO, "bench", "quality.py")


def _report(tmp_path, *modes):
    fixtures = comfy_inproc.fixtures_module()
    ckpt = str(tmp_path / "tiny.safetensors")
    fixtures.build_checkpoint(comfy_inproc.COMFY, "sd15", "tiny", ckpt, seed=2)
    out = str(tmp_path / "report.md")
    cmd = [sys.executable, SCRIPT, "--ckpt", ckpt, "--comfy-dir", comfy_inproc.COMFY, "--cpu", "--limit", "2",
           "--steps", "3", "--size", "64", "--out", out]
    for m in modes:
        cmd += ["--mode", m]
    # as a user runs it: no Triton interpreter (the suite's CPU default), so on the CPU the stock modules run
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        text = f.read()
    with open(str(tmp_path / "report.json")) as f:
        return text, json.load(f)


def test_the_report_compares_each_mode_with_the_reference_image_by_image(tmp_path):
    text, data = _report(tmp_path, "fp16", "step_cache=interval 2")
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["reference", "fp16", "step_cache=interval 2"]
    assert data["prompts"][0].startswith("a photograph of an astronaut") and len(data["prompts"]) == 2
    again = rows["fp16"]
    assert not again["lossy"] and again["psnr"] == [math.inf, math.inf], "the same inputs render the same image"
    cached = rows["step_cache=interval 2"]
    assert cached["lossy"] and cached["inputs"] == {"step_cache": "interval 2"}
    line = next(ln for ln in text.splitlines() if ln.startswith("| step_cache=interval 2 |"))
    assert "| LOSSY |" in line
    if "refused" in cached["note"] or "ComfyUI 2024" in cached["note"]:
        assert "ComfyUI 2024" in cached["note"] and cached["psnr"] == [math.inf, math.inf]
    else:
        assert all(math.isfinite(v) and 10 < v < 99 for v in cached["psnr"]), cached["psnr"]
        assert "LOSSY: 1 of 3 steps ran the shallow blocks only" in cached["note"]
        assert abs(cached["psnr_mean"] - sum(cached["psnr"]) / 2) < 1e-9
    for metric, key in (("LPIPS", "lpips_mean"), ("CLIP score", "clip_mean")):
        said = [s for s in data["not_computed"] if s.startswith(metric + " not computed: ")]
        assert (key in cached) != bool(said), (metric, data["not_computed"])
        assert all(("- " + s) in text for s in said)


def test_a_mode_that_is_not_an_accelerated_ksampler_input_is_refused_by_name(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--ckpt", str(tmp_path / "none.safetensors"), "--comfy-dir",
                           comfy_inproc.COMFY, "--cpu", "--mode", "fp9=on", "--out", str(tmp_path / "r.md")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    assert "'fp9' is not an Accelerated KSampler input" in proc.stderr + proc.stdout
