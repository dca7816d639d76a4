"""Other packs' patch mechanisms through the real server (CPU), with SD Accel in the same graph.

The packs are stand-ins (tests/packs/standin_*) that register their patches on the ModelPatcher and run on
every call what the real packs do (docs/other_packs.md says what each reproduces, and from which files).
A graph runs as the stock reference (pack -> KSampler) and in the ways SD Accel meets it: pack -> Accelerated
KSampler ("ours"), Apply SD Accel -> pack -> KSampler ("apply_first": our patches under theirs) and pack ->
Apply SD Accel -> KSampler ("apply_last": theirs under ours); same seed. With fused kernels off the outputs
must be identical to the byte (our wrapper and patch plumbing change nothing); with them on, within the float
noise of the fused modules, which run their torch references here (comfy_packs in conftest.py). Each pack
must also change the output, so an equality is never vacuous. No run may fall back to the stock path, and
the server stays up (a crash fails the next prompt).
"""
import os

import numpy as np
import pytest
from workflow_util import image, psnr, txt2img

SAMPLER = "3"
# The fused modules' references fold adds in another order than stock: images differ in a few pixels
# (84 dB measured), latents by ~1e-6. A lost, doubled or misplaced patch is below 35 dB / above 1e-2.
IMAGE_NOISE_DB = 50.0
LATENT_NOISE = 1e-4
PACK_EFFECT_DB, PACK_EFFECT_REL = 35.0, 1e-2
ORDERS = ("ours", "apply_first", "apply_last")


# -- graphs -----------------------------------------------------------------------------------------------
def _apply(fused_kernels, attention="auto"):
    return ("SDAccelApply", {"fused_kernels": fused_kernels, "cuda_graph": True, "channels_last": True,
                             "attention": attention})


def model_graph(models, model_nodes, order="stock", fused_kernels=True, seed=7, steps=2, prefix="pk", latent=None,
                save_latent=False, attention="auto", cfg=None):
    """txt2img at test size with `model_nodes` [(class, inputs)] chained between the checkpoint and the
    sampler; `order` places SD Accel: "stock" (none), "ours" (Accelerated KSampler), "apply_first" / "apply_last"
    (Apply SD Accel before / after the pack's nodes, then KSampler). `save_latent`: the sampler's latent is
    saved instead of decoded (16 frames would cost more to decode than to sample)."""
    sampler = "SDAccelKSampler" if order == "ours" else "KSampler"
    accel = {"fused_kernels": fused_kernels, "attention": attention} if order == "ours" else {}
    wf = txt2img(models["sd15"], sampler, seed=seed, steps=steps, prefix="%s_%s" % (prefix, order), **accel)
    chain = list(model_nodes)
    if order == "apply_first":
        chain.insert(0, _apply(fused_kernels, attention))
    elif order == "apply_last":
        chain.append(_apply(fused_kernels, attention))
    link = ["4", 0]
    for i, (cls, inputs) in enumerate(chain):
        wf["m%d" % i] = {"class_type": cls, "inputs": dict(inputs, model=link)}
        link = ["m%d" % i, 0]
    wf[SAMPLER]["inputs"]["model"] = link
    if latent:
        wf["5"]["inputs"].update(latent)
    if cfg is not None:
        wf[SAMPLER]["inputs"]["cfg"] = cfg
    if save_latent:
        del wf["8"]
        wf["9"] = {"class_type": "SaveLatent", "inputs": {"samples": [SAMPLER, 0],
                                                          "filename_prefix": "latents/%s_%s" % (prefix, order)}}
    return wf


# -- running and comparing --------------------------------------------------------------------------------
class Latent(np.ndarray):
    """A latent the prompt saved (SaveLatent), told apart from decoded images by its type."""


def run_output(srv, wf):
    """(what the prompt saved as one float array: its images stacked, or its Latent; history entry)."""
    entry = srv.run(wf)
    latents = [f for out in entry["outputs"].values() for f in out.get("latents", [])]
    if latents:
        import safetensors.torch
        f = latents[0]
        path = os.path.join(srv.output_dir, f.get("subfolder", ""), f["filename"])
        return safetensors.torch.load_file(path)["latent_tensor"].double().numpy().view(Latent), entry
    paths = srv.output_images(entry)
    assert paths, entry.get("outputs")
    return np.stack([image(p) for p in paths]), entry


def report_of(entry):
    """The Accelerated KSampler's report, if the graph has one; no report of the graph (a detailer passes on the
    one of its inner sampler) may have fallen back to the stock path."""
    for out in entry["outputs"].values():
        for report in out.get("sdaccel_report", ()):
            assert not [n for n in report["notes"] if "accelerated run failed" in n], report["notes"]
    reports = (entry["outputs"].get(SAMPLER) or {}).get("sdaccel_report")
    return reports[0] if reports else None


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def _is_latent(a):
    return isinstance(a, Latent)


def assert_matches(got, ref, exact, what):
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    if exact:
        assert (got == ref).all(), (what, psnr(got, ref) if not _is_latent(got) else _rel(got, ref))
    elif _is_latent(got):
        assert _rel(got, ref) <= LATENT_NOISE, (what, _rel(got, ref))
    else:
        assert psnr(got, ref) >= IMAGE_NOISE_DB, (what, psnr(got, ref))


def assert_changed(with_pack, without, what):
    if _is_latent(with_pack):
        assert _rel(with_pack, without) > PACK_EFFECT_REL, "%s did not change the latent" % what
    else:
        assert psnr(with_pack, without) < PACK_EFFECT_DB, "%s did not change the image" % what


def check_orders(srv, build, fused_kernels, orders=ORDERS):
    """Runs build("stock"), then build(order) for each order: each output equals stock's. Returns (stock's
    output, {order: its history entry})."""
    ref, _ = run_output(srv, build("stock"))
    entries = {}
    for order in orders:
        got, entries[order] = run_output(srv, build(order))
        report_of(entries[order])
        assert_matches(got, ref, exact=not fused_kernels, what=order)
    return ref, entries


STAND_INS = ("IPAdapterLikeApply", "ADLikeApplyMotion", "ACNLikeApply", "ACNLikeTimestepKeyframe",
             "ImpactLikeDetailer", "DeepCacheLikeApply", "FBCacheLikeApply",
             "TiledDiffusionLikeApply", "BrushNetLikeApply", "ICLightLikeApply", "ICLightLikeConditioning",
             "SmZLikeSettings", "FooocusInpaintLikeApply")


def test_every_stand_in_pack_loads_beside_ours(comfy_packs):
    bad = [ln for ln in comfy_packs.log_text().splitlines() if "IMPORT FAILED" in ln and "standin_" in ln]
    assert not bad, bad
    info = comfy_packs.object_info()
    assert not [n for n in STAND_INS + ("SDAccelKSampler", "SDAccelApply") if n not in info]


# -- IPAdapter: attn2 replace patches ---------------------------------------------------------------------
def ipadapter(weight=1.5, start_at=0.0, end_at=0.6, seed=3):
    """end_at 0.6: on for the first of 2 steps only, so its per-call Python sigma test decides both ways."""
    return ("IPAdapterLikeApply", {"weight": weight, "start_at": start_at, "end_at": end_at, "seed": seed,
                                   "tokens": 4})


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_ipadapter_in_every_order_is_stock(comfy_packs, models, fused_kernels):
    nodes = [ipadapter()]
    ref, _ = check_orders(comfy_packs, lambda o: model_graph(models, nodes, o, fused_kernels, prefix="ipa"),
                          fused_kernels)
    if fused_kernels:
        plain, _ = run_output(comfy_packs, model_graph(models, [], "stock", prefix="ipa_none"))
        assert_changed(ref, plain, "the IPAdapter stand-in")


def test_two_stacked_ipadapters_in_every_order_are_stock(comfy_packs, models):
    """The second IPAdapter finds the first one's patch objects (in its clone's deep copy of the options) and
    adds itself to them in place."""
    nodes = [ipadapter(seed=3), ipadapter(weight=-1.0, end_at=1.0, seed=4)]
    ref, _ = check_orders(comfy_packs, lambda o: model_graph(models, nodes, o, prefix="ipa2"), fused_kernels=True)
    one, _ = run_output(comfy_packs, model_graph(models, nodes[:1], "stock", prefix="ipa2_one"))
    assert_changed(ref, one, "the second IPAdapter stand-in")


@pytest.mark.parametrize("order", ORDERS)
def test_ipadapter_keeps_its_patches_beside_our_attention_backend(comfy_packs, models, order):
    """attention=sdpa: SD Accel sets its own attn1/attn2 replace patches on every transformer block, under the
    same keys IPAdapter uses for SD1.5. The IPAdapter must still act, in either order."""
    nodes = [ipadapter()]
    ref, _ = run_output(comfy_packs, model_graph(models, nodes, "stock", prefix="ipa_attn"))
    got, entry = run_output(comfy_packs, model_graph(models, nodes, order, fused_kernels=False, attention="sdpa",
                                                     prefix="ipa_attn"))
    report_of(entry)
    assert_matches(got, ref, exact=False, what=order)


# -- AnimateDiff: injected temporal modules, sliding context windows --------------------------------------
FRAMES = {"width": 64, "height": 64, "batch_size": 16}


def animatediff(context_length=8, schedule="standard_uniform", version="v2", seed=5):
    """context_length 8 over 16 frames, overlap 4: three windows a step, moved by the step (uniform)."""
    return ("ADLikeApplyMotion", {"seed": seed, "motion_version": version, "context_length": context_length,
                                  "context_overlap": 4, "context_schedule": schedule, "fuse_method": "pyramid"})


def ad_graph(models, nodes, order, fused_kernels, prefix):
    """16 frames at cfg 1 (ComfyUI then runs no negative: half the cost of this CPU's slowest graphs; the
    cond/uncond batch is covered by the other packs' tests), the latent saved instead of decoded."""
    return model_graph(models, nodes, order, fused_kernels, prefix=prefix, latent=FRAMES, save_latent=True, cfg=1.0)


def test_animatediff_in_every_order_is_stock(comfy_packs, models):
    """Fused kernels off: no object patch of ours, so this is the injection, the wrappers and the sliding
    windows (every window's call with its own frames and ad_params) meeting our step wrapper."""
    nodes = [animatediff(8)]
    ref, _ = check_orders(comfy_packs, lambda o: ad_graph(models, nodes, o, False, "ad_windows"), fused_kernels=False)
    plain, _ = run_output(comfy_packs, ad_graph(models, [], "stock", False, "ad_none"))
    assert_changed(ref, plain, "the motion modules")


def test_animatediff_with_fused_kernels_after_a_stock_run_is_stock(comfy_packs, models):
    """The user's first AnimateDiff run is stock; ComfyUI keeps that model loaded, temporal modules inserted
    into the UNet's blocks. Then the same graph with the Accelerated KSampler: our folded copies of the blocks
    must not take those modules in (AnimateDiff inserts its own into our copies when it loads our clone)."""
    nodes = [animatediff(0, seed=6)]
    check_orders(comfy_packs, lambda o: ad_graph(models, nodes, o, True, "ad_fused"), fused_kernels=True,
                 orders=("ours",))


def test_animatediff_v1_groupnorm_across_frames_is_kept_with_fused_kernels(comfy_packs, models):
    """AnimateDiff v1 models swap the GroupNorm classes' forward during the UNet call so that each norm spans
    all frames; our fused norms must not bypass it. The plain model is loaded first, so that our blocks are
    planned with no AnimateDiff model injected (the hazard of the test above) and only this one is tested."""
    run_output(comfy_packs, model_graph(models, [], "stock", prefix="ad_v1_unload"))
    nodes = [animatediff(0, version="v1", seed=9)]
    got, entry = run_output(comfy_packs, ad_graph(models, nodes, "ours", True, "ad_v1"))
    report_of(entry)
    ref, _ = run_output(comfy_packs, ad_graph(models, nodes, "stock", True, "ad_v1"))
    assert_matches(got, ref, exact=False, what="ours")


def test_animatediff_injects_into_an_sd15_layout_with_fused_kernels(comfy_packs, models):
    """SD1.5's deepest level has no attention: AnimateDiff places a temporal module there after the first block
    whose class is named "ResBlock" (an exact name test), so our ResBlock stand-ins must leave it a place."""
    run_output(comfy_packs, model_graph(models, [], "stock", prefix="ad_deep_unload"))   # no AnimateDiff loaded
    deep = dict(models, sd15=models["sd15_small_plain_deep"])
    nodes = [animatediff(0, seed=10)]
    got, entry = run_output(comfy_packs, ad_graph(deep, nodes, "ours", True, "ad_deep"))
    report_of(entry)
    ref, _ = run_output(comfy_packs, ad_graph(deep, nodes, "stock", True, "ad_deep"))
    assert_matches(got, ref, exact=False, what="ours")


def refine_after_animatediff(models, order):
    """One prompt: AnimateDiff over 16 frames with ComfyUI's KSampler, then its first frame refined (denoise 0.6)
    by a second sampler on the plain model: KSampler ("stock") or the Accelerated KSampler ("ours"). The second
    sampler runs while the AnimateDiff clone of the same checkpoint is still loaded and injected (this prompt's
    cache holds it)."""
    wf = ad_graph(models, [animatediff(8, seed=7)], "stock", False, "refine_%s" % order)
    wf["r_pick"] = {"class_type": "LatentFromBatch", "inputs": {"samples": [SAMPLER, 0], "batch_index": 0,
                                                                "length": 1}}
    second = dict(wf[SAMPLER]["inputs"], model=["4", 0], latent_image=["r_pick", 0], denoise=0.6, cfg=7.0)
    if order == "ours":
        # channels_last off (nothing on a CPU): options no other test uses, so that the plan is made here, not
        # found in the cache of clones of the plain model
        second.update(fused_kernels=True, cuda_graph=True, channels_last=False)
    wf["r"] = {"class_type": "SDAccelKSampler" if order == "ours" else "KSampler", "inputs": second}
    wf["9"]["inputs"]["samples"] = ["r", 0]
    return wf


def test_a_plain_sampler_after_an_animatediff_sampler_in_one_prompt_is_stock(comfy_packs, models):
    """The hazard of the fused test above without AnimateDiff in the accelerated sampler's model: the plain
    model's blocks are planned while the AnimateDiff clone is loaded, its temporal modules in the blocks."""
    got, entry = run_output(comfy_packs, refine_after_animatediff(models, "ours"))   # first: its AnimateDiff
    ref, _ = run_output(comfy_packs, refine_after_animatediff(models, "stock"))     # sampler runs, not cached
    report_of(entry)
    assert entry["outputs"]["r"]["sdaccel_report"], "the second sampler is the Accelerated KSampler"
    assert_matches(got, ref, exact=False, what="ours")


# -- Advanced-ControlNet: its ControlNet subclass, timestep keyframes, soft weights -----------------------
KEYFRAMES = ((0.0, 0.3), (0.25, 2.5), (0.6, 0.0))   # (start_percent, strength): 3 steps at 0.3, 2.5, 0


def add_controlnets(wf, models, chain, keyframes=KEYFRAMES, base_multiplier=0.825):
    """Applies the fixture ControlNet on a flat-colour hint, once per entry of `chain` (bottom to top):
    "acn" through the Advanced-ControlNet stand-in (with `keyframes` and soft weights), "stock" through
    ComfyUI's Apply ControlNet (Advanced)."""
    wf["c_load"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": models["cn15"]}}
    wf["c_hint"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                            "color": 0xC04020}}
    kf = None
    for i, (start, strength) in enumerate(keyframes):
        wf["c_kf%d" % i] = {"class_type": "ACNLikeTimestepKeyframe", "inputs": dict(
            {"start_percent": start, "strength": strength, "guarantee_steps": 1},
            **({"prev_timestep_kf": kf} if kf else {}))}
        kf = ["c_kf%d" % i, 0]
    pos, neg = ["6", 0], ["7", 0]
    for i, kind in enumerate(chain):
        common = {"positive": pos, "negative": neg, "control_net": ["c_load", 0], "image": ["c_hint", 0],
                  "strength": 0.9, "start_percent": 0.0, "end_percent": 1.0}
        if kind == "acn":
            node = {"class_type": "ACNLikeApply", "inputs": dict(common, base_multiplier=base_multiplier,
                                                                 **({"timestep_kf": kf} if kf else {}))}
        else:
            node = {"class_type": "ControlNetApplyAdvanced", "inputs": common}
        wf["c_apply%d" % i] = node
        pos, neg = ["c_apply%d" % i, 0], ["c_apply%d" % i, 1]
    wf[SAMPLER]["inputs"].update(positive=pos, negative=neg)
    return wf


def cn_graph(models, chain, order, fused_kernels=True, prefix="acn", keyframes=KEYFRAMES):
    order = "apply_first" if order == "apply" else order    # the pack patches no model: one Apply order
    wf = model_graph(models, [], order, fused_kernels, steps=3, prefix=prefix)
    return add_controlnets(wf, models, chain, keyframes)


def test_advanced_controlnet_in_every_order_is_stock_and_its_keyframes_act(comfy_packs, models):
    """Its subclass runs stock inside our run: ours patches only ComfyUI's own ControlNet class, and says so."""
    ref, entries = check_orders(comfy_packs, lambda o: cn_graph(models, ["acn"], o, prefix="acn"), fused_kernels=True,
                                orders=("ours", "apply"))
    notes = " ".join(report_of(entries["ours"])["notes"])
    assert "left stock: ControlNetAdvancedLike is not a full ControlNet" in notes, notes
    without, _ = run_output(comfy_packs, cn_graph(models, ["acn"], "stock", prefix="acn_nokf", keyframes=()))
    assert_changed(ref, without, "the keyframe schedule")


@pytest.mark.parametrize("chain", [["acn", "stock"], ["stock", "acn"]], ids=["stock_over_acn", "acn_over_stock"])
def test_advanced_controlnet_chained_with_a_stock_controlnet_is_stock(comfy_packs, models, chain):
    """Chained with a ComfyUI ControlNet, which ours does accelerate (and re-links), above or below it."""
    check_orders(comfy_packs, lambda o: cn_graph(models, chain, o, prefix="acn_" + "_".join(chain)),
                 fused_kernels=True, orders=("ours", "apply"))


# -- Impact Pack: a detailer sampling a crop at another size inside its node ------------------------------
def detailer_graph(models, order, ksampler="impact", fused_kernels=True, prefix="det", detail=True):
    """txt2img, then the detailer on a 32 px region upscaled to 48 px (a 6x6 latent after the main pass's 8x8).
    `order`: "stock"; "ours": Accelerated KSampler for the main pass, the detailer's `ksampler` for the region;
    "apply": Apply SD Accel on the model both samplers use."""
    wf = model_graph(models, [], "apply_first" if order == "apply" else order, fused_kernels, prefix=prefix)
    if not detail:
        return wf
    wf["d"] = {"class_type": "ImpactLikeDetailer", "inputs": {
        "image": ["8", 0], "model": wf[SAMPLER]["inputs"]["model"], "vae": ["4", 2], "positive": ["6", 0],
        "negative": ["7", 0], "seed": 11, "steps": 2, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
        "denoise": 0.5, "crop": "16,16,48,48", "guide_size": 48, "noise_mask": True, "noise_mask_feather": 4,
        "ksampler": ksampler}}
    wf["9"]["inputs"]["images"] = ["d", 0]
    return wf


def test_detailer_with_a_ksampler_inside_is_stock_with_ours_inside(comfy_packs, models):
    """The detailer calls KSampler (stock graph) or the Accelerated KSampler (ours) on the region."""
    ref, _ = run_output(comfy_packs, detailer_graph(models, "stock", "KSampler", prefix="det_ks"))
    got, entry = run_output(comfy_packs, detailer_graph(models, "ours", "SDAccelKSampler", prefix="det_ks"))
    assert_matches(got, ref, exact=False, what="Accelerated KSampler inside the detailer")
    assert entry["outputs"]["d"]["sdaccel_report"], "the detailer's inner Accelerated KSampler reported"
    report_of(entry)


def test_detailer_sampling_the_impact_way_on_an_accelerated_model_is_stock(comfy_packs, models):
    ref, _ = check_orders(comfy_packs, lambda o: detailer_graph(models, o, prefix="det_impact"), fused_kernels=True,
                          orders=("apply",))
    plain, _ = run_output(comfy_packs, detailer_graph(models, "stock", prefix="det_impact", detail=False))
    assert_changed(ref, plain, "the detailer")


# -- DeepCache packs: a model_function_wrapper that runs the UNet's blocks itself --------------------------------
def deepcache(interval=4, depth=0):
    """The first of 4 steps whole, the other 3 stopping after the first input block."""
    return ("DeepCacheLikeApply", {"cache_interval": interval, "cache_depth": depth})


def _is_2024(srv):
    return not srv.get("/system_stats").get("system", {}).get("comfyui_version")


def test_deepcache_loop_runs_the_hosts_modules_bit_for_bit_and_says_so(comfy_packs, models):
    """Its loop never calls apply_model, where SD Accel's step is: without the guard (hosts/comfyui/unet_bypass.py)
    the fused modules ran eagerly inside it (here their torch references, a few last bits off stock's). Guarded, it
    runs the host's own modules: stock's image to the bit, fused kernels on, in each order SD Accel meets it, and
    the report names the wrapper. ComfyUI 2024 has no OUTER_SAMPLE wrappers, through which current ComfyUI guards a
    run whose pack came after Apply SD Accel (the pack's single-slot wrapper replaces ours there): that order is
    checked on current ComfyUI only (README, Limits)."""
    nodes = [deepcache()]
    orders = ("ours", "apply_last") if _is_2024(comfy_packs) else ORDERS
    ref, entries = check_orders(comfy_packs, lambda o: model_graph(models, nodes, o, True, prefix="dc", steps=4),
                                fused_kernels=False, orders=orders)
    report = report_of(entries["ours"])
    assert "ran the UNet's blocks itself" in report["fell_back"].get("cuda_graph", ""), report["fell_back"]
    assert "DeepCacheLikeApply" in report["fell_back"]["cuda_graph"], report["fell_back"]
    plain, _ = run_output(comfy_packs, model_graph(models, [], "stock", prefix="dc_none", steps=4))
    assert_changed(ref, plain, "the DeepCache stand-in")


# -- WaveSpeed's First Block Cache: the UNet's _forward replaced per call, host reads decide the cache ----------
def fbcache(threshold=0.5):
    return ("FBCacheLikeApply", {"residual_diff_threshold": threshold, "start": 0.0, "end": 1.0,
                                 "max_consecutive_cache_hits": -1})


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_first_block_cache_in_every_order_is_stock(comfy_packs, models, fused_kernels):
    """Its wrapper calls the model function (SD Accel's step) with the UNet's `_forward` set on the instance for
    the call: the step runs the pack's forward, whose cache decisions read GPU values on the host. In every order,
    stock's output; the pack must have used its cache (the output differs from the plain graph's)."""
    if _is_2024(comfy_packs):
        pytest.skip("WaveSpeed's First Block Cache patches UNetModel._forward, which ComfyUI 2024 does not have")
    nodes = [fbcache()]
    ref, entries = check_orders(comfy_packs, lambda o: model_graph(models, nodes, o, fused_kernels, prefix="fbc",
                                                                     steps=6), fused_kernels)
    plain, _ = run_output(comfy_packs, model_graph(models, [], "stock", prefix="fbc_none", steps=6))
    assert_changed(ref, plain, "the First Block Cache stand-in")
    # no graph for a UNet whose _forward another pack set: the cache decision it reads from the second step on
    # cannot be probed on a key's first calls (the report says why)
    refused = report_of(entries["ours"])["graphs"].get("refused") or {}
    assert any("replaced the UNet's _forward" in r for r in refused), refused


# -- Tiled Diffusion: the model function called per batch of tiles -----------------------------------------------
def tiled(method):
    """64 px: 48 px tiles overlapping by 16 px, two tiles per call: two calls of the model function per step."""
    return ("TiledDiffusionLikeApply", {"method": method, "tile_width": 48, "tile_height": 48, "tile_overlap": 16,
                                        "tile_batch_size": 2})


@pytest.mark.parametrize("method,fused_kernels", [("MultiDiffusion", False), ("Mixture of Diffusers", True)],
                         ids=["multidiffusion_plumbing_exact", "mixture_of_diffusers_fused"])
def test_tiled_diffusion_in_every_order_is_stock(comfy_packs, models, method, fused_kernels):
    """Its wrapper calls the model function (SD Accel's step) once per batch of tiles, each call a latent of the
    tile's shape with the conditioning repeated to it; its state (the grid, the output buffer) lives on the wrapper
    object. In every order, stock's output, and tiling changed it."""
    nodes = [tiled(method)]
    ref, _ = check_orders(comfy_packs, lambda o: model_graph(models, nodes, o, fused_kernels, prefix="td"),
                          fused_kernels)
    plain, _ = run_output(comfy_packs, model_graph(models, [], "stock", prefix="td_none"))
    assert_changed(ref, plain, "the Tiled Diffusion stand-in (%s)" % method)


def add_square_image(wf, prefix, name, ground, square, size, at):
    """Nodes making a 64 px image of colour `ground` with a `size` (w, h) square of colour `square` at `at` (x, y),
    the last of them named `name`."""
    wf[prefix + "_dark"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                                   "color": ground}}
    wf[prefix + "_light"] = {"class_type": "EmptyImage", "inputs": {"width": size[0], "height": size[1],
                                                                    "batch_size": 1, "color": square}}
    wf[name] = {"class_type": "ImageCompositeMasked", "inputs": {
        "destination": [prefix + "_dark", 0], "source": [prefix + "_light", 0], "x": at[0], "y": at[1],
        "resize_source": False}}


def tiled_cn_graph(models, order, fused_kernels, with_cn=True, with_tiles=True, prefix="tdcn"):
    """Tiled Diffusion (MultiDiffusion) with a ComfyUI ControlNet whose hint is not uniform (a light square on a
    dark image, off-centre), so each tile's cut of it differs."""
    wf = model_graph(models, [tiled("MultiDiffusion")] if with_tiles else [], order, fused_kernels, prefix=prefix)
    if not with_cn:
        return wf
    wf["c_load"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": models["cn15"]}}
    add_square_image(wf, "c", "c_hint", 0x101010, 0xF0E0C0, (24, 16), (8, 36))
    wf["c_apply"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["6", 0], "negative": ["7", 0], "control_net": ["c_load", 0], "image": ["c_hint", 0],
        "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}}
    wf[SAMPLER]["inputs"].update(positive=["c_apply", 0], negative=["c_apply", 1])
    return wf


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_tiled_diffusion_with_a_controlnet_in_every_order_is_stock(comfy_packs, models, fused_kernels):
    """The pack makes the ControlNet hand itself to its wrapper (`get_control` set on the instance), then runs it
    per batch of tiles on the hint cut into the same tiles (`cond_hint` set per call), through the `get_control` it
    saved: on an Accelerated KSampler's run, the ControlNet copy SD Accel made for it. In every order, stock's
    output; the ControlNet acted, and so did the tiling."""
    ref, _ = check_orders(comfy_packs, lambda o: tiled_cn_graph(models, o, fused_kernels), fused_kernels)
    no_cn, _ = run_output(comfy_packs, tiled_cn_graph(models, "stock", fused_kernels, with_cn=False,
                                                      prefix="tdcn_nocn"))
    no_tiles, _ = run_output(comfy_packs, tiled_cn_graph(models, "stock", fused_kernels, with_tiles=False,
                                                         prefix="tdcn_notiles"))
    assert_changed(ref, no_cn, "the ControlNet under Tiled Diffusion")
    assert_changed(ref, no_tiles, "Tiled Diffusion with a ControlNet")


# -- BrushNet: every block's layers given an instance forward per run, tensors set on them per call ----------------
def brushnet_graph(models, order, fused_kernels, scale=1.0, seed=7, prefix="bn"):
    """Inpainting as BrushNet's example graphs wire it: the checkpoint's model, VAE, an image, its mask and the two
    prompts into the BrushNet node, whose model, prompts and (empty) latent go to the sampler. The image is a light
    square on a dark ground, the mask its red channel (the square, softly)."""
    nodes = [("BrushNetLikeApply", {"scale": scale, "start_at": 0, "end_at": 10000, "dtype": "float32", "seed": 1})]
    wf = model_graph(models, nodes, order, fused_kernels, seed=seed, steps=3, prefix=prefix)
    add_square_image(wf, "b", "b_image", 0x203040, 0xF0C080, (32, 24), (16, 8))
    wf["b_mask"] = {"class_type": "ImageToMask", "inputs": {"image": ["b_image", 0], "channel": "red"}}
    node = next(k for k, v in wf.items() if v["class_type"] == "BrushNetLikeApply")
    sampler = wf[SAMPLER]["inputs"]
    wf[node]["inputs"].update(vae=["4", 2], image=["b_image", 0], mask=["b_mask", 0], positive=sampler["positive"],
                              negative=sampler["negative"])
    sampler.update(positive=[node, 1], negative=[node, 2], latent_image=[node, 3])
    return wf


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_brushnet_in_every_order_is_stock(comfy_packs, models, fused_kernels):
    """BrushNet's run wrapper sets a forward on the instance of every layer of every UNet block; before each call
    its apply_model wrapper reads the sigma on the host and sets the BrushNet network's samples on the blocks' last
    layers, which their patched forwards add. With Apply SD Accel before it, its `wrappers.update` drops SD Accel's
    wrappers of the same types. In every order, stock's output, and BrushNet's samples acted (the output differs
    from the graph without it, and from the one with its scale at 0)."""
    if _is_2024(comfy_packs):
        pytest.skip("BrushNet's current release hooks ComfyUI's model wrappers, which ComfyUI 2024 does not have")
    ref, entries = check_orders(comfy_packs, lambda o: brushnet_graph(models, o, fused_kernels), fused_kernels)
    unscaled, _ = run_output(comfy_packs, brushnet_graph(models, "stock", fused_kernels, scale=0.0,
                                                         prefix="bn_scale0"))
    assert_changed(ref, unscaled, "BrushNet's samples")
    # two prompts in a row: the second finds the model loaded (ComfyUI re-applies our patches; BrushNet hooks what
    # the tree held after the first)
    ours = [run_output(comfy_packs, brushnet_graph(models, "ours", fused_kernels, seed=s, prefix="bn_%d" % s))[0]
            for s in (8, 9)]
    for s, got in zip((8, 9), ours):
        want, _ = run_output(comfy_packs, brushnet_graph(models, "stock", fused_kernels, seed=s, prefix="bn_%d" % s))
        assert_matches(got, want, exact=not fused_kernels, what="ours, seed %d" % s)
    # no graph while layers carry its forward: the tensors it hands them per call are no graph inputs
    refused = report_of(entries["ours"])["graphs"].get("refused") or {}
    assert any("another pack set the forward of" in r for r in refused), refused
    if fused_kernels:   # its hooks sit on the original blocks our copies displaced: those give way
        assert any("give way to the modules it hooked" in r for r in refused), refused


def iclight_graph(models, order, fused_kernels, multiplier=0.18215, seed=7, prefix="icl"):
    """Relighting as IC-Light's fc example graphs wire it: the checkpoint's model through the IC-Light loader, the
    foreground (a light square on a dark ground) VAE-encoded into the IC-Light conditioning with both prompts, whose
    prompts and empty latent go to the sampler."""
    wf = model_graph(models, [("ICLightLikeApply", {"model_path": models["iclight15_small"]})], order,
                     fused_kernels, seed=seed, steps=2, prefix=prefix)
    add_square_image(wf, "i", "i_image", 0x303030, 0xE0C0A0, (24, 32), (20, 16))
    wf["i_fg"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["i_image", 0], "vae": ["4", 2]}}
    sampler = wf[SAMPLER]["inputs"]
    wf["i_cond"] = {"class_type": "ICLightLikeConditioning", "inputs": {
        "positive": sampler["positive"], "negative": sampler["negative"], "foreground": ["i_fg", 0],
        "multiplier": multiplier}}
    sampler.update(positive=["i_cond", 0], negative=["i_cond", 1], latent_image=["i_cond", 2])
    return wf


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_iclight_in_every_order_is_stock_and_leaves_the_checkpoint_as_it_was(comfy_packs, models, fused_kernels):
    """IC-Light's weight patches pad the input conv from 4 to 8 channels at load (a patched weight of another shape
    than the checkpoint's) and change every other weight; its own extra_conds hands the foreground's latent to the
    UNet as c_concat. In every order, stock's output; the foreground acted (another multiplier, another output);
    and afterwards the plain checkpoint gives the output it gave before, with SD Accel and without (the padded
    conv and the patched weights went back)."""
    if _is_2024(comfy_packs):
        pytest.skip("IC-Light pads a weight through ComfyUI's pad_weight, which ComfyUI 2024 does not have")
    plain = lambda o, p: model_graph(models, [], o, fused_kernels, seed=7, steps=2, prefix=p)  # noqa: E731
    before, _ = run_output(comfy_packs, plain("stock", "icl_plain_before"))
    ref, entries = check_orders(comfy_packs, lambda o: iclight_graph(models, o, fused_kernels), fused_kernels)
    other, _ = run_output(comfy_packs, iclight_graph(models, "stock", fused_kernels, multiplier=0.5,
                                                     prefix="icl_mult"))
    assert_changed(ref, other, "IC-Light's foreground")
    assert_changed(ref, before, "IC-Light's weights")
    for order in ("stock", "ours"):
        after, _ = run_output(comfy_packs, plain(order, "icl_plain_after_" + order))
        assert_matches(after, before, exact=not fused_kernels or order == "stock", what="plain after, " + order)


def test_brushnet_between_accelerated_prompts_is_stock_and_so_is_stock_after_them(comfy_packs, models):
    """BrushNet hooks the layers in the tree when its run begins, before ComfyUI loads the model. After an accelerated
    prompt that tree held SD Accel's folded copies, which the load then replaced (by this clone's copies, or by the
    originals for stock's): its samples went to modules no longer in the tree. On the CPU, in process, the image
    moved by 0.46 (latent rel. L2), for the Accelerated KSampler and for a stock KSampler after it alike. Now the
    model's own blocks are back in the tree whenever a run ends."""
    if _is_2024(comfy_packs):
        pytest.skip("BrushNet's current release hooks ComfyUI's model wrappers, which ComfyUI 2024 does not have")
    plain = lambda order, p: model_graph(models, [], order, True, prefix=p)  # noqa: E731
    run_output(comfy_packs, plain("stock", "bnq_plain_stock"))     # a stock clone loaded: the tree is the model's
    want, _ = run_output(comfy_packs, brushnet_graph(models, "stock", True, seed=11, prefix="bnq_ref"))
    for what in ("ours", "ours again", "stock"):
        run_output(comfy_packs, plain("ours", "bnq_plain_ours"))
        order = what.split()[0]
        got, entry = run_output(comfy_packs, brushnet_graph(models, order, True, seed=11, prefix="bnq_" + order))
        report_of(entry)
        assert_matches(got, want, exact=order == "stock", what=what + ", after an accelerated prompt")


# -- smZNodes: ComfyUI's sampling functions replaced at import, for every graph -----------------------------------
@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
@pytest.mark.parametrize("setting", ["ngms", "ensd"])
def test_smz_settings_in_every_order_is_stock(comfy_packs, models, setting, fused_kernels):
    """smZ's hooks are in this server for every graph (the other tests here run beside them). With its Settings
    on the model, NGMS skips the uncond on the odd steps (a UNet call of half the batch: cfg 1.0 there; 4 steps, as
    the second of 2 is at a sigma where the guidance hardly shows; latents, as the random model's guidance is weak), and ENSD moves the noise's seed, found by
    prepare_noise on a `model` local of its callers: the Accelerated KSampler must hand ComfyUI's sampler the
    model the user's graph gave it, through ComfyUI's own functions."""
    settings = {"ngms": {"s_min_uncond": 100.0, "ENSD": 0}, "ensd": {"s_min_uncond": 0.0, "ENSD": 31337}}[setting]
    nodes = [("SmZLikeSettings", settings)]
    build = lambda o: model_graph(models, nodes, o, fused_kernels, steps=4, save_latent=True,  # noqa: E731
                                  prefix="smz_" + setting)
    ref, _ = check_orders(comfy_packs, build, fused_kernels)
    plain, _ = run_output(comfy_packs, model_graph(models, [], "stock", steps=4, save_latent=True, prefix="smz_none"))
    assert_changed(ref, plain, "smZ's " + setting)


# -- Fooocus inpaint: a weight patch type of its own (ComfyUI's calculate_weight replaced), a stateful block patch ----
def fooocus_graph(models, order, fused_kernels, spread=0.05, seed=7, prefix="fi"):
    """Inpainting as comfyui-inpaint-nodes' example graphs wire it: an image VAE-encoded with a noise mask (the
    light square, from the image's red channel) into Apply Fooocus Inpaint and into the sampler, on the
    checkpoint's model patched by it."""
    nodes = [("FooocusInpaintLikeApply", {"seed": 1, "spread": spread})] if spread is not None else []
    wf = model_graph(models, nodes, order, fused_kernels, seed=seed, steps=3, prefix=prefix)
    add_square_image(wf, "f", "f_image", 0x203040, 0xF0C080, (32, 24), (16, 8))
    wf["f_mask"] = {"class_type": "ImageToMask", "inputs": {"image": ["f_image", 0], "channel": "red"}}
    wf["f_encoded"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["f_image", 0], "vae": ["4", 2]}}
    wf["f_latent"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["f_encoded", 0],
                                                                     "mask": ["f_mask", 0]}}
    for node in wf.values():
        if node["class_type"] == "FooocusInpaintLikeApply":
            node["inputs"]["latent"] = ["f_latent", 0]
    wf[SAMPLER]["inputs"]["latent_image"] = ["f_latent", 0]
    return wf


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["plumbing_exact", "fused"])
def test_fooocus_inpaint_in_every_order_is_stock_and_leaves_the_checkpoint_as_it_was(comfy_packs, models,
                                                                                      fused_kernels):
    """Fooocus inpaint patches every UNet weight with a patch type of its own, which its replacement of ComfyUI's
    calculate_weight adds at load, and adds its head's feature after input block 0 from a copy it makes on the
    first call and keeps on the patch object. In every order, stock's output; the patch acted (another output than
    the same masked graph without it, and than with its weight patch at 0); and afterwards the plain checkpoint gives
    the output it gave before, with SD Accel and without (its weight patches went back)."""
    if _is_2024(comfy_packs):
        pytest.skip("Fooocus inpaint replaces comfy.lora.calculate_weight, which ComfyUI 2024 does not have")
    plain = lambda o, p: model_graph(models, [], o, fused_kernels, seed=7, steps=2, prefix=p)  # noqa: E731
    before, _ = run_output(comfy_packs, plain("stock", "fi_plain_before"))
    ref, _ = check_orders(comfy_packs, lambda o: fooocus_graph(models, o, fused_kernels), fused_kernels)
    without, _ = run_output(comfy_packs, fooocus_graph(models, "stock", fused_kernels, spread=None,
                                                       prefix="fi_none"))
    head_only, _ = run_output(comfy_packs, fooocus_graph(models, "stock", fused_kernels, spread=0.0,
                                                         prefix="fi_head"))
    assert_changed(ref, without, "Fooocus inpaint")
    assert_changed(ref, head_only, "Fooocus inpaint's weight patch")
    assert_changed(head_only, without, "Fooocus inpaint's head")
    for order in ("stock", "ours"):
        after, _ = run_output(comfy_packs, plain(order, "fi_plain_after_" + order))
        assert_matches(after, before, exact=not fused_kernels or order == "stock", what="plain after, " + order)
