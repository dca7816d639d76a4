"""GPU only (run on the GPU machine with tests/gpu): the other packs' mechanisms (the stand-ins of tests/packs,
docs/other_packs.md) with CUDA graphs on. In-process on the current ComfyUI, same models as test_graphs_gpu.py
(its `comfy_env` fixture). For each pack: the accelerated output equals stock's with the same pack (within
fp16 noise, as test_graphs_gpu.py), and on a second prompt the step either replays graphs or its report names
why it did not (`report["graphs"]["refused"]`: {one-line reason: calls}). Never a stale replay: the cases that
change what a step computes without changing a tensor shape (IPAdapter's per-call sigma test, a second
IPAdapter on a model whose graphs exist, AnimateDiff's windows moved by the step, keyframe strengths) are each
compared with stock on a prompt whose graphs already exist.
"""
import importlib.util
import os
import sys

import pytest
import torch

from test_graphs_gpu import COMFY, REPO, WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA GPU; run it on the GPU machine", pytrace=False)

PACKS = os.path.join(REPO, "tests", "packs")
FP16_NOISE = 2e-2          # rel. L2 of the latent against stock, as test_graphs_gpu.py
PACK_EFFECT = 0.1          # a pack's own change of the latent, well above that noise
ORDERS = ("ours", "apply_first", "apply_last")


def _load_pack(name):
    """A stand-in pack imported as ComfyUI imports a custom-node folder (its __init__.py as a package)."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(PACKS, name, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def packs(comfy_env):  # noqa: F811
    return {n: _load_pack("standin_" + n) for n in ("ipadapter", "animatediff", "advanced_controlnet", "impact",
                                                      "deepcache", "fbcache", "tiled_diffusion", "brushnet",
                                                      "iclight")}


# -- sampling ---------------------------------------------------------------------------------------------
def _apply_ours(model):
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    return SDAccelApply().apply(model)["result"][0]


def _run(env, model, order, pos=None, neg=None, latent=None, seed=5, steps=6, cfg=7.0, denoise=1.0):
    """(latent samples as float, our report or None). `order`: "stock", "ours" (Accelerated KSampler), or
    "apply" (KSampler on a model Apply SD Accel already patched: the caller builds that model)."""
    pos, neg = pos or env.pos, neg or env.neg
    with torch.inference_mode():
        latent = latent or env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        if order == "ours":
            res = env.ours.sample(model, seed, steps, cfg, "euler", "normal", pos, neg, latent, denoise=denoise)
            report = res["ui"]["sdaccel_report"][0]
            assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]
            return res["result"][0]["samples"].float(), report
        out = env.nodes.KSampler().sample(model, seed, steps, cfg, "euler", "normal", pos, neg, latent,
                                          denoise=denoise)[0]
        return out["samples"].float(), None


def _models_in_order(build, plain):
    """{order: (model, sampler order)}: the pack's nodes on the plain model for stock and ours, with Apply SD
    Accel before them (apply_first) or after them (apply_last)."""
    return {"stock": (build(plain), "stock"), "ours": (build(plain), "ours"),
            "apply_first": (build(_apply_ours(plain)), "apply"), "apply_last": (_apply_ours(build(plain)), "apply")}


def assert_graphs_used_or_refused(report, what):
    """Our step on a prompt whose graphs were made before: replayed, or refused with one-line reasons."""
    graphs = report["graphs"]
    refused = graphs.get("refused") or {}
    assert graphs.get("replays", 0) > 0 or refused, (what, graphs)
    for reason, calls in refused.items():
        assert isinstance(reason, str) and reason.strip() and "\n" not in reason and calls > 0, (what, refused)


def check_every_order(env, build, run_kwargs, what, orders=ORDERS):
    """Each order twice (the second prompt finds the first one's graphs), then stock: all equal to stock; graphs
    used or refused on the second Accelerated KSampler run. Stock runs last: a stock AnimateDiff clone left
    loaded would have its temporal modules in the blocks our plans start from (tested on its own below)."""
    by_order = _models_in_order(build, env.model)
    outs = {(order, attempt): _run(env, by_order[order][0], by_order[order][1], **run_kwargs)
            for order in orders for attempt in (1, 2)}
    ref, _ = _run(env, by_order["stock"][0], "stock", **run_kwargs)
    assert torch.isfinite(ref).all(), (what, "stock's own output is not finite: the stand-in pack is broken")
    for (order, attempt), (out, report) in outs.items():
        assert _rel(out, ref) < FP16_NOISE, (what, order, attempt, _rel(out, ref), report and report["graphs"])
        if report is not None and attempt == 2:
            assert_graphs_used_or_refused(report, (what, order))
    return ref


# -- IPAdapter --------------------------------------------------------------------------------------------
def _ipadapter(packs, model, seed=3, weight=1.5, end_at=0.6):
    return packs["ipadapter"].IPAdapterLikeApply().apply(model, weight, 0.0, end_at, seed, 4)[0]


def test_ipadapter_with_graphs_is_stock_in_every_order(comfy_env, packs):  # noqa: F811
    """end_at 0.6: the adapter acts on the first steps only, decided per call from a host read of sigma."""
    check_every_order(comfy_env, lambda m: _ipadapter(packs, m), {}, "ipadapter")


def test_a_second_ipadapter_on_a_model_whose_graphs_exist_never_replays_them(comfy_env, packs):  # noqa: F811
    """The second IPAdapter clones the first one's model (ComfyUI deep-copies the options, patch objects
    included) and .add()s itself to the copies: same UNet, same shapes, new patch objects with two adapters."""
    first = _ipadapter(packs, comfy_env.model, seed=3)
    first_out, _ = _run(comfy_env, first, "ours")
    _run(comfy_env, first, "ours")                   # its graphs (or refusals) exist now
    both = _ipadapter(packs, first, seed=4, weight=-1.0, end_at=1.0)
    ref, _ = _run(comfy_env, both, "stock")
    out, report = _run(comfy_env, both, "ours")
    assert _rel(out, ref) < FP16_NOISE, (_rel(out, ref), report["graphs"])
    assert _rel(first_out, ref) > PACK_EFFECT, "the second IPAdapter had no effect"
    again, _ = _run(comfy_env, first, "ours")        # the first model is unchanged by the second node
    first_ref, _ = _run(comfy_env, first, "stock")
    assert _rel(again, first_ref) < FP16_NOISE, _rel(again, first_ref)


# -- AnimateDiff ------------------------------------------------------------------------------------------
def _frames(env):
    with torch.inference_mode():
        return env.nodes.EmptyLatentImage().generate(64, 64, 16)[0]


def _animatediff(packs, model, context_length=8, version="v2", seed=5):
    return packs["animatediff"].ADLikeApplyMotion().apply(model, seed, version, context_length, 4,
                                                          "standard_uniform", "pyramid")[0]


def _unload_all():
    import comfy.model_management as mm
    mm.unload_all_models()


def test_animatediff_sliding_windows_with_graphs_are_stock_in_every_order(comfy_env, packs):  # noqa: F811
    """Three windows a step, moved by the step: every window's call has its own frames (ad_params.sub_idxs)
    and the temporal modules' Python state. Nothing else loaded before, so our blocks are planned clean."""
    _unload_all()
    check_every_order(comfy_env, lambda m: _animatediff(packs, m), {"latent": _frames(comfy_env), "steps": 4},
                      "animatediff")


def test_animatediff_after_a_stock_run_with_graphs_is_stock(comfy_env, packs):  # noqa: F811
    """A stock AnimateDiff run first, its clone left loaded with the temporal modules in the UNet's blocks."""
    model = _animatediff(packs, comfy_env.model, context_length=0, seed=6)
    ref, _ = _run(comfy_env, model, "stock", latent=_frames(comfy_env), steps=4)
    out, report = _run(comfy_env, model, "ours", latent=_frames(comfy_env), steps=4)
    assert _rel(out, ref) < FP16_NOISE, (_rel(out, ref), report["graphs"])


def test_animatediff_v1_groupnorm_across_frames_with_graphs_is_stock(comfy_env, packs):  # noqa: F811
    _unload_all()
    model = _animatediff(packs, comfy_env.model, context_length=0, version="v1", seed=9)
    out, report = _run(comfy_env, model, "ours", latent=_frames(comfy_env), steps=4)
    ref, _ = _run(comfy_env, model, "stock", latent=_frames(comfy_env), steps=4)
    assert _rel(out, ref) < FP16_NOISE, (_rel(out, ref), report["graphs"])


@pytest.fixture(scope="module")
def plain_deep(comfy_env):  # noqa: F811
    """The small SD1.5 with its deepest level without attention (SD1.5's layout)."""
    import fixtures
    path = os.path.join(WORK, "checkpoints", "gpu_small_plain_deep.safetensors")
    fixtures.ensure(path, fixtures.build_checkpoint, COMFY, "sd15", "small_plain_deep", path, 3)
    with torch.inference_mode():
        return comfy_env.nodes.CheckpointLoaderSimple().load_checkpoint("gpu_small_plain_deep.safetensors")[0]


def test_animatediff_places_its_modules_in_an_sd15_layout_with_our_stand_ins(comfy_env, packs, plain_deep):  # noqa: F811
    """With channels_last and fused kernels on the GPU, our SpatialTransformer and ResBlock stand-ins are in the
    blocks when AnimateDiff injects, and its placement tests exact class names (docs/other_packs.md)."""
    _unload_all()
    model = _animatediff(packs, plain_deep, context_length=0, seed=10)
    out, report = _run(comfy_env, model, "ours", latent=_frames(comfy_env), steps=4)
    ref, _ = _run(comfy_env, model, "stock", latent=_frames(comfy_env), steps=4)
    assert _rel(out, ref) < FP16_NOISE, (_rel(out, ref), report["graphs"])


# -- Advanced-ControlNet ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def controlnet(comfy_env):  # noqa: F811
    import fixtures
    import folder_paths
    os.makedirs(os.path.join(WORK, "controlnet"), exist_ok=True)
    folder_paths.add_model_folder_path("controlnet", os.path.join(WORK, "controlnet"), is_default=True)
    path = os.path.join(WORK, "controlnet", "gpu_small_cn.safetensors")
    fixtures.ensure(path, fixtures.build_controlnet, COMFY, "small", path, 6)
    with torch.inference_mode():
        return comfy_env.nodes.ControlNetLoader().load_controlnet("gpu_small_cn.safetensors")[0]


def _acn_conds(env, packs, cn, keyframes=((0.0, 0.3), (0.25, 2.5), (0.6, 0.0)), stock_below=False):
    acn = packs["advanced_controlnet"]
    hint = torch.full((1, 256, 256, 3), 0.6)
    pos, neg = env.pos, env.neg
    with torch.inference_mode():
        if stock_below:
            pos, neg = env.nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, cn, hint, 0.9, 0.0, 1.0)[:2]
        kf = None
        for start, strength in keyframes:
            kf = acn.ACNLikeTimestepKeyframe().load_keyframe(start, strength, 1, kf)[0]
        return acn.ACNLikeApply().apply_controlnet(pos, neg, cn, hint, 0.9, 0.0, 1.0, 0.825, kf)


@pytest.mark.parametrize("stock_below", [False, True], ids=["acn", "acn_over_stock"])
def test_advanced_controlnet_keyframes_with_graphs_are_stock(comfy_env, packs, controlnet, stock_below):  # noqa: F811
    """Keyframe strengths 0.3, 2.5 and 0 over the run: the residuals change (and vanish) from step to step;
    they are graph inputs, computed outside our step on every call."""
    pos, neg = _acn_conds(comfy_env, packs, controlnet, stock_below=stock_below)
    check_every_order(comfy_env, lambda m: m, {"pos": pos, "neg": neg}, "acn", orders=("ours", "apply_first"))


def test_tiled_diffusion_with_a_controlnet_with_graphs_is_stock_in_every_order(  # noqa: F811
        comfy_env, packs, controlnet):  # noqa: F811
    """The pack runs the ControlNet per batch of tiles, its hint cut into the same tiles (`cond_hint` set per
    call), through the `get_control` it saved from the instance: on an Accelerated KSampler's run, that of SD
    Accel's ControlNet copy (with graphs, the one that defers the ControlNet into the UNet's graph). The hint is a
    light square off-centre, so every tile's cut differs: a hint baked into a graph or taken from the wrong tile
    shows."""
    hint = torch.full((1, 256, 256, 3), 0.1)
    hint[:, 140:220, 30:120, :] = 0.9
    with torch.inference_mode():
        pos, neg = comfy_env.nodes.ControlNetApplyAdvanced().apply_controlnet(comfy_env.pos, comfy_env.neg,
                                                                              controlnet, hint, 1.0, 0.0, 1.0)[:2]
    tiled = packs["tiled_diffusion"].TiledDiffusionLikeApply()
    build = lambda m: tiled.apply(m, "MultiDiffusion", 128, 128, 32, 2)[0]  # noqa: E731
    ref = check_every_order(comfy_env, build, {"pos": pos, "neg": neg}, "tiled diffusion with a controlnet")
    no_cn, _ = _run(comfy_env, build(comfy_env.model), "stock")
    assert _rel(ref, no_cn) > 2 * FP16_NOISE, ("the ControlNet changed the latent too little to test", _rel(ref, no_cn))


# -- Impact Pack detailer ---------------------------------------------------------------------------------
def _detail(env, packs, image, model, ksampler):
    with torch.inference_mode():
        out = packs["impact"].ImpactLikeDetailer().doit(image, model, env.vae, env.pos, env.neg, 11, 4, 7.0, "euler",
                                                       "normal", 0.5, "64,64,192,192", 192, True, 4, ksampler)
    if isinstance(out, dict):
        return out["result"][0].float(), out["ui"]["sdaccel_report"][0]
    return out[0].float(), None


def test_detailer_with_graphs_inside_is_stock(comfy_env, packs, monkeypatch):  # noqa: F811
    """A 128 px region at 192 px (a latent of another shape than the 256 px image's), sampled by KSampler or the
    Accelerated KSampler inside the node, or Impact's own way on a model Apply SD Accel patched."""
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    monkeypatch.setitem(comfy_env.nodes.NODE_CLASS_MAPPINGS, "SDAccelKSampler", SDAccelKSampler)
    base, _ = _run(comfy_env, comfy_env.model, "stock")
    with torch.inference_mode():
        image = comfy_env.vae.decode(base)
    ref, _ = _detail(comfy_env, packs, image, comfy_env.model, "KSampler")
    for attempt in (1, 2):
        out, report = _detail(comfy_env, packs, image, comfy_env.model, "SDAccelKSampler")
        assert _rel(out, ref) < FP16_NOISE, (attempt, _rel(out, ref), report["graphs"])
        assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]
    assert_graphs_used_or_refused(report, "detailer")
    impact_ref, _ = _detail(comfy_env, packs, image, comfy_env.model, "impact")
    impact_ours, _ = _detail(comfy_env, packs, image, _apply_ours(comfy_env.model), "impact")
    assert _rel(impact_ours, impact_ref) < FP16_NOISE, _rel(impact_ours, impact_ref)


# -- DeepCache packs: the UNet run by the wrapper, never through apply_model --------------------------------
def test_deepcache_loop_runs_the_hosts_modules_and_is_stock_in_every_order(comfy_env, packs):  # noqa: F811
    """Its calls never reach our step (no graphs there): the guard runs them on the host's own modules, so the
    latent is stock's to the bit in every order, and the report names the wrapper."""
    build = lambda m: packs["deepcache"].DeepCacheLikeApply().apply(m, 3, 1)[0]  # noqa: E731
    by_order = _models_in_order(build, comfy_env.model)
    # the packs pass the conditioning to the UNet's blocks as they find it: on the GPU in the ComfyUI they were
    # written for; current ComfyUI leaves it on the CPU until apply_model, where stock fails with the pack alone
    pos, neg = (_on_gpu(c) for c in (comfy_env.pos, comfy_env.neg))
    ref, _ = _run(comfy_env, by_order["stock"][0], "stock", pos, neg)
    for order in ORDERS:
        out, report = _run(comfy_env, by_order[order][0], by_order[order][1], pos, neg)
        assert torch.equal(out, ref), (order, _rel(out, ref))
        if report is not None:
            assert any("ran the UNet's blocks itself" in r for r in report["graphs"]["refused"]), report["graphs"]


def _on_gpu(conditioning):
    return [[t.cuda(), {k: v.cuda() if torch.is_tensor(v) else v for k, v in d.items()}] for t, d in conditioning]


# -- WaveSpeed's First Block Cache: the UNet's _forward set per call, cache decisions read on the host ----------
def test_first_block_cache_with_graphs_is_stock_in_every_order(comfy_env, packs):  # noqa: F811
    """Its wrapper sets the UNet's `_forward` on the instance around each call of the model function (SD Accel's
    step), and that forward decides by `.item()` of values it computed whether the rest of the UNet runs: a capture
    would bake one decision in, so the step must refuse the key and run it eagerly, stock's latent in every order.
    At threshold 0.5 it runs 2 of 6 steps whole here (the residual moves by 0.7 after the first, then ~0.2: far
    from the threshold, so fp16 noise cannot flip a decision); its effect on the latent is ~0.06 (CPU, fp32)."""
    build = lambda m: packs["fbcache"].FBCacheLikeApply().apply(m, 0.5)[0]  # noqa: E731
    ref = check_every_order(comfy_env, build, {}, "fbcache")
    plain, _ = _run(comfy_env, comfy_env.model, "stock")
    assert _rel(ref, plain) > 2 * FP16_NOISE, ("the cache changed the latent too little to test", _rel(ref, plain))
    _, report = _run(comfy_env, build(comfy_env.model), "ours")
    assert report["graphs"].get("refused") and not report["graphs"].get("replays"), report["graphs"]


# -- Tiled Diffusion: the model function called per batch of tiles ----------------------------------------------
@pytest.mark.parametrize("method", ["MultiDiffusion", "Mixture of Diffusers"])
def test_tiled_diffusion_replays_graphs_per_tile_shape_and_is_stock_in_every_order(  # noqa: F811
        comfy_env, packs, method):  # noqa: F811
    """256 px in 128 px tiles overlapping by 32 px, two per call: 9 tiles in 5 calls per step, the last one a
    single tile (another shape). The wrapper's host read of the sigma is outside SD Accel's step, and the tiles are
    the step's inputs: each tile shape replays its graph, and every order gives stock's latent."""
    tiled = packs["tiled_diffusion"].TiledDiffusionLikeApply()
    build = lambda m: tiled.apply(m, method, 128, 128, 32, 2)[0]  # noqa: E731
    ref = check_every_order(comfy_env, build, {}, "tiled diffusion")
    plain, _ = _run(comfy_env, comfy_env.model, "stock")
    # Mixture of Diffusers' weighted blend moves a random-weight model's latent by about 0.1: twice the noise
    # bound is enough for an untiled run to fail the comparison with stock
    assert _rel(ref, plain) > 2 * FP16_NOISE, ("tiling changed the latent too little to test", _rel(ref, plain))
    _, report = _run(comfy_env, build(comfy_env.model), "ours")
    assert report["graphs"]["replays"] >= 5 * 5 and not report["graphs"].get("refused"), (report["graphs"],
                                                                                          report["fell_back"])


# -- torch.compile (ComfyUI's TorchCompileModel): SD Accel leaves the UNet to it -------------------------------
def test_torch_compile_model_in_every_order_is_stock_with_the_same_compile(comfy_env):  # noqa: F811
    """dynamo traces what runs inside the compiled diffusion model, which must never be SD Accel's stand-ins, and
    SD Accel captures nothing around it. The node's backends do not serve here: "cudagraphs" fails in stock under
    ComfyUI's default allocator (cudaMallocAsync: torch's CUDA graph trees check their pool's live allocations,
    which that allocator cannot), and "inductor" compiles for minutes; "aot_eager" traces the same graph through
    dynamo and AOTAutograd. One compiled model serves stock and the orders that compile before SD Accel; Apply SD
    Accel then the compile node is a second compile, over the host's own modules."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    compile_ = lambda m: TorchCompileModel.execute(m, "aot_eager")[0]  # noqa: E731
    compiled = compile_(comfy_env.model)
    ref, _ = _run(comfy_env, compiled, "stock")
    runs = {"ours": _run(comfy_env, compiled, "ours"),
            "apply_last": _run(comfy_env, _apply_ours(compiled), "apply"),
            "apply_first": _run(comfy_env, compile_(_apply_ours(comfy_env.model)), "apply")}
    for order, (out, report) in runs.items():
        assert _rel(out, ref) < FP16_NOISE, (order, _rel(out, ref))
        if report is not None:
            assert list(report["fell_back"]) == ["SD Accel"] and "torch.compile" in report["fell_back"]["SD Accel"], \
                report
            assert not report["graphs"].get("captures"), report["graphs"]



# -- BrushNet: a forward on every block layer's instance per run, its samples handed over as layer attributes ------
def _square_image():
    """A 256 px inpainting input: a light square on a dark ground; its red channel masks the square."""
    image = torch.full((1, 256, 256, 3), 0.15)
    image[:, 64:160, 96:224] = torch.tensor([0.95, 0.75, 0.5])
    return image


def _brushnet(packs, env, model, scale=1.0):
    """The BrushNet stand-in on `_square_image`, masked by itself."""
    image = _square_image()
    mask = image[..., 0].clone()
    with torch.inference_mode():
        return packs["brushnet"].BrushNetLikeApply().model_update(model, env.vae, image, mask, env.pos, env.neg,
                                                                  scale, 0, 10000, "float16", 1)[0]


def test_brushnet_with_graphs_on_runs_eagerly_and_is_stock_in_every_order(comfy_env, packs):  # noqa: F811
    """Before each call its apply_model wrapper sets new tensors on the blocks' last layers, which their per-run
    forwards add: a replay would add the tensors of the call it captured. So no graph while they are hooked, and
    where our copies displaced the modules it hooked (the first load), the originals come back for the run. In
    every order, twice, stock's latent; its samples changed the latent; the report says why no graph ran."""
    build = lambda m: _brushnet(packs, comfy_env, m)  # noqa: E731
    ref = check_every_order(comfy_env, build, {}, "brushnet")
    unscaled, _ = _run(comfy_env, _brushnet(packs, comfy_env, comfy_env.model, scale=0.0), "stock")
    assert _rel(ref, unscaled) > 2 * FP16_NOISE, ("BrushNet's samples changed the latent too little to test",
                                                  _rel(ref, unscaled))
    out, report = _run(comfy_env, build(comfy_env.model), "ours", seed=9)
    ref9, _ = _run(comfy_env, build(comfy_env.model), "stock", seed=9)
    assert _rel(out, ref9) < FP16_NOISE, (_rel(out, ref9), report["graphs"])
    refused = report["graphs"].get("refused") or {}
    assert any("another pack set the forward of" in r for r in refused) and not report["graphs"].get("replays"), \
        report["graphs"]


# -- IC-Light ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def iclight_unet(comfy_env):  # noqa: F811
    """IC-Light fc offsets for the test checkpoint's layout (8 input channels), where its loader looks."""
    import folder_paths
    import fixtures
    folder = os.path.join(WORK, "diffusion_models")
    os.makedirs(folder, exist_ok=True)
    folder_paths.add_model_folder_path("diffusion_models", folder, is_default=True)
    path = os.path.join(folder, "gpu_small_iclight_offsets.safetensors")
    fixtures.ensure(path, fixtures.build_iclight_offsets, COMFY, "small", path, 7)
    return os.path.basename(path)


def _iclight_inputs(env, packs, multiplier=0.18215):
    """(positive, negative, empty latent) of the IC-Light conditioning on a 256 px foreground: a light square on a dark
    ground, VAE-encoded."""
    image = torch.full((1, 256, 256, 3), 0.2)
    image[:, 48:176, 80:208] = torch.tensor([0.9, 0.8, 0.6])
    with torch.inference_mode():
        fg = env.nodes.VAEEncode().encode(env.vae, image)[0]
        return packs["iclight"].ICLightLikeConditioning().encode(env.pos, env.neg, fg, multiplier)


def test_iclight_with_graphs_is_stock_in_every_order_and_after(comfy_env, packs, iclight_unet):  # noqa: F811
    """IC-Light's weight patches pad the input conv from 4 to 8 channels at each load and change every weight; its
    extra_conds hands the foreground's latent to the UNet as c_concat. In every order, twice, stock's latent with
    graphs used or refused; the foreground acted; and then the plain model's latent is stock's again, with the
    graphs and the conv layout it had before (the padded conv went back at the unload)."""
    config = comfy_env.model.model.model_config.unet_config
    saved = config["in_channels"]
    plain_ref, _ = _run(comfy_env, comfy_env.model, "stock", seed=4)
    try:
        pos, neg, latent = _iclight_inputs(comfy_env, packs)
        build = lambda m: packs["iclight"].ICLightLikeApply().load(m, iclight_unet)[0]  # noqa: E731
        ref = check_every_order(comfy_env, build, {"pos": pos, "neg": neg, "latent": latent}, "iclight")
        pos2, neg2, _ = _iclight_inputs(comfy_env, packs, multiplier=0.6)
        other, _ = _run(comfy_env, build(comfy_env.model), "stock", pos=pos2, neg=neg2, latent=latent)
        assert _rel(ref, other) > 2 * FP16_NOISE, ("the foreground changed the latent too little to test",
                                                   _rel(ref, other))
    finally:
        config["in_channels"] = saved   # the pack writes it into the checkpoint's shared config
    _unload_all()
    for attempt in (1, 2):
        out, report = _run(comfy_env, comfy_env.model, "ours", seed=4)
        assert _rel(out, plain_ref) < FP16_NOISE, (attempt, _rel(out, plain_ref), report["graphs"])
    ref_after, _ = _run(comfy_env, comfy_env.model, "stock", seed=4)
    assert _rel(ref_after, plain_ref) < 1e-3, ("stock's own latent changed after the IC-Light runs",
                                               _rel(ref_after, plain_ref))


# -- smZNodes: ComfyUI's sampling functions replaced at import --------------------------------------------------
@pytest.fixture
def smz(comfy_env):  # noqa: F811
    """smZ's hooks for one test: in a real ComfyUI they stay for every graph (the CPU server tests have them so);
    here they go at the end, so the other GPU tests in this process run without them."""
    mod = _load_pack("standin_smz")
    mod._register_hooks()
    yield mod
    mod._unregister_hooks()


def test_smz_settings_with_graphs_are_stock_in_every_order(comfy_env, smz):  # noqa: F811
    """NGMS skips the uncond on the odd steps below its sigma (a UNet call of half the batch, decided by a host read
    of the sigmas outside the step), and ENSD moves the noise's seed, found on a `model` local of prepare_noise's
    callers: the half-batch calls are other graph keys, never a replay of the full batch's graph."""
    build = lambda m: smz.SmZLikeSettings().apply(m, 100.0, 31337)[0]  # noqa: E731
    ref = check_every_order(comfy_env, build, {}, "smz")
    plain, _ = _run(comfy_env, comfy_env.model, "stock")
    assert _rel(ref, plain) > 2 * FP16_NOISE, ("smZ's settings changed the latent too little to test", _rel(ref, plain))


# -- Fooocus inpaint: a weight patch type of its own, a block patch that keeps a copy made on its first call ------
@pytest.fixture
def fooocus(comfy_env):  # noqa: F811
    """The stand-in for one test: its Apply replaces comfy.lora.calculate_weight for good (as the pack does in a
    real ComfyUI); here ComfyUI's own comes back at the end, so the other GPU tests run without it."""
    import comfy.lora
    mod = _load_pack("standin_fooocus_inpaint")
    yield mod
    if mod._state["original"] is not None:
        comfy.lora.calculate_weight, mod._state["original"] = mod._state["original"], None


def _masked_latent(env):
    """`_square_image` VAE-encoded, with the square as its noise mask."""
    image = _square_image()
    with torch.inference_mode():
        latent = env.nodes.VAEEncode().encode(env.vae, image)[0]
        return env.nodes.SetLatentNoiseMask().set_mask(latent, image[..., 0].clone())[0]


def test_fooocus_inpaint_with_graphs_is_stock_in_every_order_and_replays(comfy_env, fooocus):  # noqa: F811
    """Its block patch makes the head's feature on the call's device on its first call and keeps it on the patch
    object (Python state the first call changes, unchanged after): the key's second probe finds nothing changed, so
    the step is captured and replayed, reading the kept copy. In every order, twice, stock's latent; the patch acted;
    and a second prompt on the same model replays graphs with nothing refused."""
    latent = _masked_latent(comfy_env)
    build = lambda m: fooocus.FooocusInpaintLikeApply().patch(m, latent, 1, 0.05)[0]  # noqa: E731
    ref = check_every_order(comfy_env, build, {"latent": latent}, "fooocus inpaint")
    without, _ = _run(comfy_env, comfy_env.model, "stock", latent=latent)
    assert _rel(ref, without) > 2 * FP16_NOISE, ("Fooocus inpaint changed the latent too little to test",
                                                 _rel(ref, without))
    model = build(comfy_env.model)
    _run(comfy_env, model, "ours", latent=latent, seed=9)    # the first prompt on this model captures
    out, report = _run(comfy_env, model, "ours", latent=latent, seed=9)
    ref9, _ = _run(comfy_env, model, "stock", latent=latent, seed=9)
    assert _rel(out, ref9) < FP16_NOISE, (_rel(out, ref9), report["graphs"])
    graphs = report["graphs"]
    assert graphs.get("replays", 0) > 0 and not graphs.get("refused"), graphs
