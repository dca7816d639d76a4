"""precision fp8 (LOSSY) on the GPU machine, in process on current ComfyUI: FP8 engages only on sm_89/sm_90,
stays near fp16, replays CUDA graphs and never replays FP8 weights of an earlier LoRA.
`python3 -m pytest tests/gpu/test_fp8_gpu.py -q`."""

import pytest
import torch

from test_graphs_gpu import _lora, _rel, _sample, comfy_env  # noqa: F401  (the shared module fixture)

FP8_GPU = torch.cuda.get_device_capability() in ((8, 9), (9, 0))
FP8_TOL = 0.15     # the small random checkpoint's final latent after 6 steps, fp8 vs fp16


def _checkpoints_as_diffusion_models():
    import os
    import folder_paths
    from test_graphs_gpu import WORK
    folder_paths.add_model_folder_path("diffusion_models", os.path.join(WORK, "checkpoints"), is_default=True)


def fp8_stored_unet():
    """The small GPU checkpoint's UNet loaded as UNETLoader weight_dtype fp8_e4m3fn loads it."""
    import patch_nodes
    _checkpoints_as_diffusion_models()
    return patch_nodes.load_fp8_unet("gpu_small.safetensors")


def fp8_fast_unet():
    """The same UNet as UNETLoader weight_dtype fp8_e4m3fn_fast loads it: on sm_89/sm_90 ComfyUI's fp8_ops
    Linears multiply in FP8 (`torch._scaled_mm` over the input cast to fp8)."""
    import nodes
    _checkpoints_as_diffusion_models()
    with torch.inference_mode():
        return nodes.UNETLoader().load_unet("gpu_small.safetensors", "fp8_e4m3fn_fast")[0]


def _with_lora(env, unet, strength):
    with torch.inference_mode():
        return env.nodes.LoraLoaderModelOnly().load_lora_model_only(unet, "gpu_small_lora.safetensors", strength)[0]


def _sample_fp8(env, model, size=256, seed=5, steps=6):
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(size, size, 1)[0]
        res = env.ours.sample(model, seed, steps, 7.0, "euler", "normal", env.pos, env.neg, lat, precision="fp8")
    return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]


def test_fp8_engages_only_where_supported(comfy_env):
    out, rep = _sample_fp8(comfy_env, comfy_env.model)
    ran_fp8 = any(r.startswith("fp8_linear (LOSSY)") for r in rep["ran"])
    assert ran_fp8 == FP8_GPU, rep
    if not FP8_GPU:
        assert "sm_89/sm_90" in rep["fell_back"]["precision fp8"], rep


@pytest.mark.skipif(not FP8_GPU, reason="FP8 compute needs sm_89/sm_90; the refusal is tested above")
def test_fp8_near_fp16_and_replays_graphs(comfy_env):
    ref, _ = _sample(comfy_env, comfy_env.model)
    out, rep = _sample_fp8(comfy_env, comfy_env.model)
    out2, rep2 = _sample_fp8(comfy_env, comfy_env.model)
    assert 0 < _rel(out, ref) < FP8_TOL, _rel(out, ref)
    assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, rep2["graphs"]
    assert torch.equal(out, out2)


@pytest.mark.skipif(not FP8_GPU, reason="FP8 compute needs sm_89/sm_90")
def test_lora_changes_never_replay_stale_fp8_weights(comfy_env):
    """A stale replay would give the FP8 image of the model without the LoRA: the FP8 image with the LoRA must have
    moved from it by about what the LoRA moves the fp16 image (FP8's own error, ~0.1 here, is of the same size as
    this small LoRA's effect, so each is compared with its own kind), and stay within FP8's error of fp16's."""
    base8, _ = _sample_fp8(comfy_env, comfy_env.model)
    base16, _ = _sample(comfy_env, comfy_env.model)
    for strength in (1.0, -0.7):
        m = _lora(comfy_env, strength)
        stock, _ = _sample(comfy_env, m, ours=False)
        ref16, _ = _sample(comfy_env, m)
        out8, rep = _sample_fp8(comfy_env, m)
        effect, moved, err = _rel(ref16, base16), _rel(out8, base8), _rel(out8, ref16)
        detail = (strength, "fp16 LoRA effect %.4f, fp8 moved %.4f, fp8 vs fp16 %.4f, fp16 vs stock %.4f" % (
            effect, moved, err, _rel(ref16, stock)), rep["graphs"])
        assert effect > 5e-2 and _rel(ref16, stock) < 2e-2, detail
        assert moved > 0.5 * effect and err < FP8_TOL, detail
    again, _ = _sample_fp8(comfy_env, comfy_env.model)
    assert torch.equal(again, base8)


def test_an_fp8_stored_unet_through_lora_changes_equals_stock_and_replays(comfy_env):
    """An fp8-stored UNet (UNETLoader fp8_e4m3fn) at precision fp16 computes with kept fp16 copies of its weights
    (engine/fp8/upcast.py). A LoRA patches new fp8 weights in: their copies are made on the first step after the
    change, outside the capture (copies made inside one live in the graph's memory and were freed under it: the
    replay failed with CUDA "invalid argument"), and each strength's image is stock's."""
    unet = fp8_stored_unet()

    def with_lora(strength):
        return _with_lora(comfy_env, unet, strength)
    # planned while a stock clone with a LoRA is loaded (its patched weights in the shared model): the stand-ins
    # must compute with the originals ComfyUI restores, not the LoRA's weights they saw at planning
    plain_ref, _ = _sample(comfy_env, unet, ours=False)
    lora_ref, _ = _sample(comfy_env, with_lora(1.0), ours=False)
    plain, _ = _sample(comfy_env, unet)
    assert _rel(lora_ref, plain_ref) > 5e-2 and _rel(plain, plain_ref) < 2e-2, (_rel(lora_ref, plain_ref),
                                                                               _rel(plain, plain_ref))
    for strength in (1.0, -0.7, 1.0):
        m = with_lora(strength)
        ref, _ = _sample(comfy_env, m, ours=False)
        out, rep = _sample(comfy_env, m)
        again, rep2 = _sample(comfy_env, m)
        assert "fp8-stored weights" not in rep["fell_back"], rep["fell_back"]
        assert _rel(out, ref) < 2e-2 and _rel(again, ref) < 2e-2, (strength, _rel(out, ref), _rel(again, ref))
        assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, (strength, rep2["graphs"])


_COLD_CACHE_FIRST_STEP = r"""
import json, os, sys, tempfile, types
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sdaccel_cold_triton_")
repo = sys.argv[1]
pkg = types.ModuleType("sd_accel")
pkg.__path__ = [repo]
sys.modules["sd_accel"] = pkg
import torch
from sd_accel.engine.fp8 import gemm, support
from sd_accel.engine.fp8.linear import Fp8Forward
from sd_accel.engine.graphs.step_graphs import StepGraphs
from sd_accel.kernels import _triton
torch.manual_seed(0)
lin = torch.nn.Linear(320, 2560).cuda().half()
x = torch.randn(2, 64, 320, device="cuda", dtype=torch.float16)
why = support.refusal(torch.device("cuda"))      # what a host asks when it plans precision fp8
fp8 = Fp8Forward(lin)
graphs = StepGraphs(lin, name="fp8 step")
with torch.no_grad():     # the key's first calls (warm-ups, watched for host reads), its capture, then replays
    outs = [graphs.run(fp8.sdaccel_geglu, (x,), {}, warm_after_change=True) for _ in range(5)]
print("RESULT " + json.dumps({"refusal": why, "ahead": _triton.compile_ahead_available(),
                              "geglu_in_epilogue": outs[0] is not None, "refused": dict(graphs.refused),
                              "captures": graphs.stats["captures"], "replayed": graphs.stats["replays"] >= 1,
                              "replay_equal": bool(torch.equal(outs[-1], outs[-2])),
                              "chosen": gemm._chosen.get(("cuda", x.device.index), "unsettled")}))
"""


@pytest.mark.skipif(not FP8_GPU, reason="FP8 compute needs sm_89/sm_90")
def test_first_fp8_step_on_a_cold_triton_cache_keeps_the_triton_recipe_and_its_graphs():
    """A process's first FP8 GEGLU steps, on an empty Triton cache, through StepGraphs as a host runs them (a key's
    first calls eager, watched for host reads, their kernels compiled ahead with the references running meanwhile;
    then a capture and replays): the recipe was chosen when the host planned FP8, so no step reads a probe's
    result on the host (the key would get no graphs) or settles on a `_scaled_mm` recipe without the GEGLU
    epilogue."""
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _COLD_CACHE_FIRST_STEP, repo], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"refusal": None, "ahead": True, "geglu_in_epilogue": True, "refused": {}, "captures": 1,
                      "replayed": True, "replay_equal": True, "chosen": "triton"}, result


@pytest.mark.skipif(not FP8_GPU, reason="ComfyUI's fp8_ops run only on sm_89/sm_90 (elsewhere fast is plain fp8)")
def test_an_fp8_fast_unet_equals_stock_in_training_and_in_eval_mode(comfy_env, monkeypatch):
    """UNETLoader's fp8_e4m3fn_fast: the Linears are ComfyUI's fp8_ops, which multiply in FP8 only in eval mode
    (`not self.training`) and otherwise cast and call F.linear. ComfyUI 0.3.64 leaves the UNet in training mode:
    there SD Accel computes them from kept fp16 copies, as for a plain fp8 load, and ours is stock's image with
    graphs. Put in eval mode after that, stock multiplies in FP8 (another image): ours captures again (the mode is
    part of the graphs' fingerprint) and every Linear runs ComfyUI's FP8 multiply inside the capture, never the
    replay of the plain one.
    In eval mode ours is held to FP8's own error of stock's FP8 image, not to fp16's: the inputs are cast to fp8
    without a scale, so the last-bit differences of the fused norms flip fp8 roundings, and over 6 steps at CFG 7
    they grow to the size of FP8's error itself (0.07 against stock's 0.09 from the plain image on the H100)."""
    import comfy.ops
    from sd_accel.engine.fp8 import upcast, weights
    from sd_accel.hosts.comfyui import host_casts
    host_casts.register()    # ComfyUI's plain cast forwards known (what is_fp8_stored reads)
    unet = fp8_fast_unet()
    linears = [m for m in unet.model.diffusion_model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m).__qualname__.startswith("fp8_ops") for m in linears), type(linears[0])
    assert unet.model.diffusion_model.training and all(upcast.is_fp8_stored(m) for m in linears)
    fp8_multiplies = set()
    host_fp8_linear = comfy.ops.fp8_linear

    def counted(module, x):     # ComfyUI's FP8 multiply, each layer that ran it noted
        out = host_fp8_linear(module, x)
        if out is not None:
            fp8_multiplies.add(id(module))
        return out
    monkeypatch.setattr(comfy.ops, "fp8_linear", counted)

    ref, _ = _sample(comfy_env, unet, ours=False)
    out, rep = _sample(comfy_env, unet)
    again, rep2 = _sample(comfy_env, unet)
    assert _rel(out, ref) < 2e-2 and _rel(again, ref) < 2e-2, (_rel(out, ref), _rel(again, ref), rep["graphs"])
    assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, rep2["graphs"]
    assert all(weights.upcast_copies_of(m.weight) for m in linears)
    assert not fp8_multiplies, len(fp8_multiplies)     # training mode: no FP8 multiply, stock's or ours

    unet.model.eval()
    try:
        ref_eval, _ = _sample(comfy_env, unet, ours=False)
        assert len(fp8_multiplies) == len(linears), (len(fp8_multiplies), len(linears))
        fp8_multiplies.clear()
        out_eval, rep_eval = _sample(comfy_env, unet)
        ours_fp8 = len(fp8_multiplies)
        again_eval, rep_eval2 = _sample(comfy_env, unet)
    finally:
        unet.model.train()
    stock_moved = _rel(ref_eval, ref)
    detail = ("stock eval vs train %.4f, ours eval vs stock eval %.4f / again %.4f, ours eval vs ours train %.4f"
              % (stock_moved, _rel(out_eval, ref_eval), _rel(again_eval, ref_eval), _rel(out_eval, out)),
              rep_eval["graphs"], rep_eval2["graphs"])
    assert stock_moved > 5e-2, detail                   # stock's FP8 multiplies make another image
    assert ours_fp8 == len(linears), (ours_fp8, len(linears))   # every Linear: ComfyUI's FP8 multiply, in ours too
    assert _rel(out_eval, out) > 0.5 * stock_moved, detail      # not the training-mode graph replayed
    assert _rel(out_eval, ref_eval) < FP8_TOL and _rel(again_eval, ref_eval) < FP8_TOL, detail
    assert rep_eval["graphs"]["captures"] >= 1 and rep_eval2["graphs"]["replays"] >= 5, detail
    assert rep_eval2["graphs"]["captures"] == 0, detail


def test_an_fp8_stored_unet_kept_as_stored_replays_graphs_and_equals_stock(comfy_env):
    """fp8_weights "as stored": no fp16 copies of the Linears and convolutions (cast a group at a time inside the
    graph), but the fused norms keep fp16 copies of their few fp8 weights. Those copies must be made before a
    capture: made inside one, every capture failed and the steps ran eagerly, slower than stock
    (bench_fp8_stored)."""
    unet = fp8_stored_unet()
    ref, _ = _sample(comfy_env, unet, ours=False)
    with torch.inference_mode():
        lat = comfy_env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        runs = [comfy_env.ours.sample(unet, 5, 6, 7.0, "euler", "normal", comfy_env.pos, comfy_env.neg, lat,
                                      fp8_weights="as stored") for _ in range(2)]
    (out, rep), (again, rep2) = [(r["result"][0]["samples"].float(), r["ui"]["sdaccel_report"][0]) for r in runs]
    assert any(n.startswith("fp8-stored weights: kept as stored") for n in rep["notes"]), rep["notes"]
    assert _rel(out, ref) < 2e-2 and _rel(again, ref) < 2e-2, (_rel(out, ref), _rel(again, ref))
    for r in (rep, rep2):
        assert not [why for why in r["graphs"].get("refused") or {} if "capture failed" in why], r["graphs"]
    assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, rep2["graphs"]


def test_as_stored_through_lora_changes_and_back_equals_stock_and_replays(comfy_env):
    """fp8_weights "as stored" through LoRA strengths and back to the plain model: each group's cast reads the
    weights through a table of their addresses made outside the captures, one per set of weights, kept for the
    graphs captured over it. Back on the plain model its earlier graph replays with the plain weights' table:
    every image is stock's."""
    unet = fp8_stored_unet()

    def with_lora(strength):
        return _with_lora(comfy_env, unet, strength)

    def as_stored(model):
        with torch.inference_mode():
            lat = comfy_env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
            res = comfy_env.ours.sample(model, 5, 6, 7.0, "euler", "normal", comfy_env.pos, comfy_env.neg, lat,
                                        fp8_weights="as stored")
        return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]

    plain_ref, _ = _sample(comfy_env, unet, ours=False)
    for strength in (None, 1.0, -0.7, None):
        m = unet if strength is None else with_lora(strength)
        ref = plain_ref if strength is None else _sample(comfy_env, m, ours=False)[0]
        out, rep = as_stored(m)
        again, rep2 = as_stored(m)
        assert any(r.startswith("fp8_upcast_group") for r in rep["ran"]), rep["ran"]
        assert _rel(out, ref) < 2e-2 and _rel(again, ref) < 2e-2, (strength, _rel(out, ref), _rel(again, ref))
        if strength is not None:
            assert _rel(ref, plain_ref) > 5e-2, (strength, _rel(ref, plain_ref))
        assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, (strength, rep2["graphs"])


@pytest.mark.parametrize("cuda_graph, step_cache", [(True, "off"), (False, "off"), (True, "interval 2")],
                         ids=["graphs", "eager", "step_cache"])
def test_as_stored_in_many_groups_equals_the_copies(comfy_env, monkeypatch, cuda_graph, step_cache):
    """"as stored" with groups small enough that the small UNet has dozens, each cast where its first layer runs and
    dropped after its last: each image equals the fp16 copies' with the same options (and stock's without the step
    cache) within fp16 noise (the two runs' kernels may differ: the eager path's per-shape choice, cuDNN's), with
    graphs, eagerly and under the step cache, whose cached steps skip the deep blocks' groups."""
    from sd_accel.engine.fp8 import block_upcast
    monkeypatch.setattr(block_upcast, "GROUP_BYTES", 1 << 20)
    unet = fp8_stored_unet()

    def run(fp8_weights, seed=5):
        with torch.inference_mode():
            lat = comfy_env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
            res = comfy_env.ours.sample(unet, seed, 6, 7.0, "euler", "normal", comfy_env.pos, comfy_env.neg, lat,
                                        cuda_graph=cuda_graph, step_cache=step_cache, fp8_weights=fp8_weights)
        return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]

    copies, _ = run("fp16 copies")
    out, rep = run("as stored")
    again, rep2 = run("as stored")
    other_seed, _ = run("as stored", seed=6)
    other_copies, _ = run("fp16 copies", seed=6)
    assert any(r.startswith("fp8_upcast_group") for r in rep["ran"]), rep["ran"]
    for a, b in ((out, copies), (again, copies), (other_seed, other_copies)):
        assert _rel(a, b) < 2e-2, (_rel(a, b), rep["graphs"])
    if step_cache == "off":
        ref, _ = _sample(comfy_env, unet, ours=False)
        assert _rel(out, ref) < 2e-2, _rel(out, ref)
    if cuda_graph:
        for r in (rep, rep2):
            assert not [why for why in r["graphs"].get("refused") or {} if "capture failed" in why], r["graphs"]
        assert rep2["graphs"]["replays"] >= 5 and rep2["graphs"]["captures"] == 0, rep2["graphs"]


def test_the_grouped_cast_gives_stocks_bits(comfy_env, monkeypatch):
    """The fp8-stored UNet's call with only its forward patches, its layers' weights cast a group at a time (dozens
    of groups, whole tiles and partial ones), gives the bits of ComfyUI's own call, which casts each layer's weight:
    eagerly and replayed from a CUDA graph (the same GEMMs and convolutions on the same values)."""
    import comfy.model_management as mm
    from sd_accel.engine.fp8 import block_upcast
    from sd_accel.engine.fp8 import weights as fp8_weights
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching
    monkeypatch.setattr(block_upcast, "GROUP_BYTES", 1 << 20)
    unet = fp8_stored_unet()
    with torch.inference_mode():     # as ComfyUI's executor loads it (the weights are inference tensors)
        mm.load_models_gpu([unet])
    dm = unet.model.diffusion_model
    dtype = unet.model.manual_cast_dtype or torch.float16
    attn2 = dm.input_blocks[1][1].transformer_blocks[0].attn2
    x = torch.randn(2, 4, 32, 32, device="cuda", dtype=dtype)
    t = torch.tensor([500.0, 500.0], device="cuda")
    ctx = torch.randn(2, 77, attn2.to_k.in_features, device="cuda", dtype=dtype)
    plan = plan_upcast(dm, grouped=True)[0]
    assert len({id(p.group) for p in plan.values() if hasattr(p, "group")}) >= 10

    def call():
        with fp8_weights.host_state(None), block_upcast.step():
            return dm(x, t, context=ctx)

    with torch.inference_mode():
        stock = dm(x, t, context=ctx)
        backup = patching.apply_patches(dm, plan)
        try:
            eager = call()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphed = call()
            graph.replay()
            torch.cuda.synchronize()
        finally:
            patching.restore(dm, backup)
    assert torch.equal(eager, stock) and torch.equal(graphed, stock)
