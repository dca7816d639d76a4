"""ComfyUI's TorchCompileModel in the same graph as SD Accel, through the real server.

torch.compile traces whatever runs inside the diffusion model; SD Accel's modules there (their kernel dispatch,
Triton's interpreter on this CPU) made dynamo fail the sampler. SD Accel leaves a compiled UNet to torch.compile
(hosts/comfyui/compiled.py) wherever it meets it: TorchCompileModel before the Accelerated KSampler, before Apply
SD Accel, or after it (then the step runs the host's own modules). Each order must give stock's latent with the
same compile node to the bit, the server must stay up, and the report must say why in one line.

The backend is "cudagraphs" (one of the node's two choices): on this CPU it traces and runs the captured graph
without a C++ build, so a prompt takes seconds, not minutes; SD Accel meets the same traced module whichever
backend compiles it. ComfyUI 2024 has no TorchCompileModel: skipped there, failed if any other ComfyUI lacks it.
"""
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

SIZE, STEPS, SEED = 64, 2, 9
COMPILE = ("TorchCompileModel", {"backend": "cudagraphs"})
APPLY = ("SDAccelApply", {"fused_kernels": True, "cuda_graph": True, "channels_last": True})


def _graph(ckpt, sampler, chain, prefix):
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse at dusk", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }
    model = ["4", 0]
    for i, (cls, inputs) in enumerate(chain):
        g["m%d" % i] = {"class_type": cls, "inputs": dict(inputs, model=model)}
        model = ["m%d" % i, 0]
    g["3"] = {"class_type": sampler, "inputs": {
        "seed": SEED, "steps": STEPS, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
        "model": model, "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}}
    if sampler == "SDAccelKSampler":   # its defaults
        g["3"]["inputs"].update(fused_kernels=True, cuda_graph=True, channels_last=True)
    g["10"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": "latents/" + prefix, "samples": ["3", 0]}}
    return g


def _run(srv, graph):
    entry = srv.run(graph)
    saved = entry["outputs"]["10"]["latents"][0]
    latent = load_file(os.path.join(srv.output_dir, saved.get("subfolder", ""), saved["filename"]))["latent_tensor"]
    return latent, entry


@pytest.fixture(scope="module")
def stock(comfy, models):
    info = comfy.object_info()
    if "TorchCompileModel" not in info:
        version = comfy.get("/system_stats").get("system", {}).get("comfyui_version") or "2024"
        if version == "2024":
            pytest.skip("ComfyUI 2024 has no TorchCompileModel (not in its /object_info)")
        pytest.fail("ComfyUI %s has no TorchCompileModel in /object_info" % version)
    spec = info["TorchCompileModel"]["input"]["required"]["backend"]
    offered = spec[0] if isinstance(spec[0], list) else (spec[1] if len(spec) > 1 else {}).get("options", [])
    assert COMPILE[1]["backend"] in offered, offered
    return _run(comfy, _graph(models["sd15"], "KSampler", [COMPILE], "compile_stock"))[0]


def _assert_stock(srv, got, ref, what):
    assert srv.proc.poll() is None, srv.log_tail()
    diff = float(np.abs(got - ref).max())
    assert diff == 0.0, (what, "latent max abs diff %.3g" % diff)


def test_compile_then_accelerated_ksampler_leaves_the_unet_to_torch_compile(comfy, models, stock):
    got, entry = _run(comfy, _graph(models["sd15"], "SDAccelKSampler", [COMPILE], "compile_ours"))
    _assert_stock(comfy, got, stock, "TorchCompileModel -> Accelerated KSampler")
    report = entry["outputs"]["3"]["sdaccel_report"][0]
    assert list(report["fell_back"]) == ["SD Accel"], report
    assert "torch.compile" in report["fell_back"]["SD Accel"] and "TorchCompileModel" in report["fell_back"]["SD Accel"]
    assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]


def test_compile_then_apply_sd_accel_says_why_and_samples_as_stock(comfy, models, stock):
    got, entry = _run(comfy, _graph(models["sd15"], "KSampler", [COMPILE, APPLY], "compile_apply"))
    _assert_stock(comfy, got, stock, "TorchCompileModel -> Apply SD Accel -> KSampler")
    line = entry["outputs"]["m1"]["text"][0]
    assert "patched: nothing" in line and "torch.compile in the graph (TorchCompileModel)" in line, line


def test_apply_sd_accel_then_compile_runs_the_hosts_modules(comfy, models, stock):
    """Apply SD Accel planned its stand-ins before the compile node existed: at each call its step wrapper finds
    the compile wrapper in the run and runs the host's own modules (what torch.compile then traces)."""
    log_start = len(comfy.log_text())
    got, _ = _run(comfy, _graph(models["sd15"], "KSampler", [APPLY, COMPILE], "apply_compile"))
    _assert_stock(comfy, got, stock, "Apply SD Accel -> TorchCompileModel -> KSampler")
    assert "Traceback" not in comfy.log_text()[log_start:], comfy.log_text()[log_start:][-3000:]
