"""The step cache (DeepCache, LOSSY) on a real ComfyUI, in-process on the CPU: ComfyUI's own sampler over a random
SD1.5 checkpoint at the "small" preset (4 input and 4 output blocks), against the plain-torch reference of
tests/step_cache_reference.py run through the stock sampler. On the CPU no graph is captured, but each call runs
what a capture records (its kind's mark, the kept feature as an input), so the latent must be the reference's bit
for bit. Needs current ComfyUI (keyed wrappers); ComfyUI 2024's refusal is its own test."""
import pytest
import torch

import comfy_inproc
import step_cache_reference as reference

STEPS = 7
OFF = dict(fused_kernels=False, cuda_graph=False, channels_last=False)


def _has_keyed_wrappers():
    comfy_inproc.fixtures_module()
    import comfy.model_patcher
    return hasattr(comfy.model_patcher.ModelPatcher, "add_wrapper_with_key")


current = pytest.mark.skipif("not _has_keyed_wrappers()", reason="ComfyUI 2024: refused, see the 2024 test")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("sc"), preset="small")


@pytest.fixture(autouse=True)
def _unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _conds(control=None, seed=11):
    g = torch.Generator().manual_seed(seed)
    extra = {} if control is None else {"control": control}
    return ([[torch.randn(1, 77, 768, generator=g), dict(extra)]],
            [[torch.randn(1, 77, 768, generator=g), dict(extra)]])


def _sample(patcher, sampler="euler", batch=1, steps=STEPS, conds=None, seed=3):
    import comfy.sample
    pos, neg = conds or _conds()
    latent = torch.zeros(batch, 4, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return comfy.sample.sample(patcher, noise, steps, 5.0, sampler, "normal", pos, neg, latent, seed=seed)


def _ours(model, mode="interval 3", branch=0, **opts):
    from sd_accel.hosts.comfyui import accelerate as host
    return host.accelerate(model, host.AccelOptions(**dict(OFF, **opts), step_cache=mode, step_cache_branch=branch))


def _reference(model, mode="interval 3", branch=0):
    clone = model.clone()
    ref = reference.ReferenceDeepCache(clone, mode, branch)
    clone.set_model_unet_function_wrapper(ref)
    return clone, ref


@current
@pytest.mark.parametrize("mode,branch", [("interval 3", 0), ("interval 2", 1), ("non-uniform 3", 0),
                                         ("interval 4", 3)])
def test_the_fast_path_is_the_reference_bit_for_bit(model, mode, branch):
    ours, info = _ours(model, mode, branch)
    got = _sample(ours)
    ref_model, ref = _reference(model, mode, branch)
    want = _sample(ref_model)
    assert torch.equal(got, want), float((got - want).abs().max())
    cached = [s for kind, s in ref.kinds if kind == "cached"]
    assert cached, ref.kinds
    s = info["step_cache"].last
    assert (s["cached_steps"], s["steps"], s["steps_reported"]) == (len(cached), STEPS, STEPS)
    assert not torch.equal(got, _sample(model)), "lossy: cached steps change the latent"


@current
@pytest.mark.parametrize("sampler", ["heun", "dpmpp_2m"])
def test_samplers_with_several_calls_or_a_history_per_step_equal_the_reference(model, sampler):
    ours, info = _ours(model, "interval 2")
    got = _sample(ours, sampler)
    ref_model, ref = _reference(model, "interval 2")
    assert torch.equal(got, _sample(ref_model, sampler))
    if sampler == "heun":   # its second call is at the next step's sigma: reported after the step, as counted
        assert len(ref.kinds) == 2 * STEPS - 1 and info["step_cache"].last["cached_calls"] > 0


@current
def test_cfg_with_a_different_batch_per_run_keeps_nothing_between_runs(model):
    """Each run starts empty: a run after runs of other batch sizes equals the same run in a fresh process."""
    from sd_accel.hosts.comfyui import step_cache as sc_host
    ours, info = _ours(model, "interval 3")
    runs = info["step_cache"].finished     # the clone is cached per input model and options: earlier tests ran it
    first = _sample(ours, batch=1)
    other = _sample(ours, batch=2, seed=9)
    again = _sample(ours, batch=1)
    assert torch.equal(first, again)
    ref_model, _ = _reference(model, "interval 3")
    assert torch.equal(other, _sample(ref_model, batch=2, seed=9))
    assert info["step_cache"].finished == runs + 3 and info["step_cache"].active_run() is None
    assert not getattr(sc_host._local, "runs", []), "no run state outlives its sampling run"


@current
def test_off_installs_nothing_and_is_stock_bit_for_bit(model):
    import comfy.patcher_extension as pe
    from sd_accel.hosts.comfyui import step_cache as sc_host
    ours, info = _ours(model, "off", cuda_graph=True)
    assert "step_cache" not in info
    assert sc_host.RUN_KEY not in ours.wrappers.get(pe.WrappersMP.SAMPLER_SAMPLE, {})
    assert sc_host.WRAPPER_KEY not in ours.wrappers.get(pe.WrappersMP.DIFFUSION_MODEL, {})
    assert torch.equal(_sample(ours), _sample(model))


@current
def test_default_options_on_the_cpu_keep_the_reference_within_fp32_noise(model):
    """Fused kernels, graphs and channels_last on, as the nodes' defaults: on this CPU the step wrapper runs the
    fused modules through Triton's interpreter, so the latent is the reference's up to fp32 rounding."""
    ours, _ = _ours(model, "interval 3", fused_kernels=True, cuda_graph=True, channels_last=True)
    got = _sample(ours, steps=4)
    ref_model, _ = _reference(model, "interval 3")
    want = _sample(ref_model, steps=4)
    assert float((got - want).norm() / want.norm()) < 1e-4


@current
def test_controlnet_residuals_of_skipped_blocks_are_skipped_with_them(model, tmp_path):
    fixtures = comfy_inproc.fixtures_module()
    import comfy.controlnet
    path = str(tmp_path / "cn.safetensors")
    fixtures.build_controlnet(comfy_inproc.COMFY, "small", path, seed=3)
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    control = comfy.controlnet.load_controlnet(path).copy().set_cond_hint(hint, 0.8, (0.0, 1.0))
    ours, _ = _ours(model, "interval 2", branch=1)
    got = _sample(ours, conds=_conds(control))
    ref_model, _ = _reference(model, "interval 2", branch=1)
    assert torch.equal(got, _sample(ref_model, conds=_conds(control)))
    assert not torch.equal(got, _sample(ours)), "the ControlNet changed nothing"


@current
def test_an_output_block_patch_that_scales_in_place_never_changes_the_kept_feature(model):
    """FreeU scales h in place at the 640-channel output blocks: branch 1 runs it on every cached call."""
    import importlib
    freeu = importlib.import_module("comfy_extras.nodes_freelunch").FreeU()
    patched = freeu.patch(model, 1.3, 1.4, 0.9, 0.2)[0]
    ours, _ = _ours(patched, "interval 3", branch=1)
    got = _sample(ours)
    ref_model, _ = _reference(patched, "interval 3", branch=1)
    assert torch.equal(got, _sample(ref_model))
    plain, _ = _ours(model, "interval 3", branch=1)
    assert not torch.equal(got, _sample(plain)), "FreeU changed nothing"


@current
def test_graph_keys_tell_the_kinds_apart_and_repeat_across_runs(model, monkeypatch):
    """Every call goes through StepGraphs.run (graphs on): all full calls share one key, all cached calls another
    whose inputs hold the feature, and the next run's calls have the same keys, so its graphs replay. (On this
    CPU the sigmas are small host tensors, which a key holds by value; on a GPU they are graph inputs, so
    their values are left out here.)"""
    from sd_accel.engine.graphs import keys
    from sd_accel.engine.graphs.step_graphs import StepGraphs
    seen = []
    run = StepGraphs.run

    def spy(self, fn, args, kwargs, **kw):
        flat = keys.flatten((args, kwargs))
        key = tuple(k[:3] if isinstance(k, tuple) and k and k[0] == "C" else k for k in flat.key)
        seen.append((args[5].get("sd_accel_step_cache")[0], key, [tuple(t.shape) for t in flat.tensors]))
        return run(self, fn, args, kwargs, **kw)
    monkeypatch.setattr(StepGraphs, "run", spy)
    ours, _ = _ours(model, "interval 3", cuda_graph=True)
    _sample(ours, steps=4)
    _sample(ours, steps=4, seed=5)
    by_kind = {}
    for kind, key, _ in seen:
        by_kind.setdefault(kind, set()).add(key)
    assert [k for k, _, _ in seen] == ["full", "cached", "cached", "full"] * 2
    assert len(by_kind["full"]) == 1 and len(by_kind["cached"]) == 1 and by_kind["full"] != by_kind["cached"]
    full_inputs = next(t for k, _, t in seen if k == "full")
    cached_inputs = next(t for k, _, t in seen if k == "cached")
    assert len(cached_inputs) == len(full_inputs) + 1, "the kept feature is one more graph input"


@current
def test_another_packs_diffusion_model_wrapper_refuses_each_call_with_one_line(model):
    import comfy.patcher_extension as pe
    other = model.clone()

    def theirs(executor, *args, **kwargs):   # decides itself how the UNet runs (EasyCache-like)
        return executor(*args, **kwargs)
    other.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "their_cache", theirs)
    ours, info = _ours(other, "interval 3")
    assert torch.equal(_sample(ours), _sample(model)), "refused: the whole UNet every step, lossless"
    s = info["step_cache"].last
    assert s["cached_calls"] == 0 and s["full_calls"] == 0
    (why, calls), = s["refused"].items()
    assert "their_cache" in why and calls == STEPS   # one CFG batch per step


@current
def test_a_branch_the_unet_does_not_have_is_refused_at_apply_time(model):
    import comfy.patcher_extension as pe
    ours, info = _ours(model, "interval 3", branch=4)
    assert "skip branch 4" in info["reasons"]["step_cache"] and "step_cache" not in info
    assert not ours.wrappers.get(pe.WrappersMP.SAMPLER_SAMPLE)
    assert torch.equal(_sample(ours), _sample(model))


def test_comfyui_2024_refuses_with_one_line_and_runs_stock(model):
    if _has_keyed_wrappers():
        pytest.skip("current ComfyUI runs the step cache (the tests above)")
    ours, info = _ours(model, "interval 3")
    why = info["reasons"]["step_cache"]
    assert "ComfyUI 2024" in why and "\n" not in why
    assert torch.equal(_sample(ours), _sample(model))


def test_only_the_ldm_unet_is_accepted():
    comfy_inproc.fixtures_module()
    from sd_accel.hosts.comfyui import step_cache_unet
    assert "not ComfyUI's UNetModel" in step_cache_unet.unsupported(torch.nn.Linear(2, 2), 0)
    unet = comfy_inproc.tiny_unet()
    assert step_cache_unet.unsupported(unet, 0) is None and step_cache_unet.unsupported(unet, 1) is None
    assert "skip branch 2" in step_cache_unet.unsupported(unet, 2)


@current
def test_vram_pool_lowvram_streaming_under_the_step_cache_changes_no_bit(model):
    """Pool -> step cache, as a workflow chains them: cached calls enter the streamed units out of order (the
    deep ones skipped), which the streamer serves by demand loads; every unit is streamed here."""
    import comfy.patcher_extension as pe
    from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    plain = _sample(_ours(model, "interval 3")[0])
    pooled = SDAccelVRAMPool().apply(model, budget_gib=8.0, offload="lowvram")["result"][0]
    settings = pooled.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)[0].sd_accel_pool
    settings.stream_every_block = True
    ours, info = _ours(pooled, "interval 3")
    assert torch.equal(_sample(ours), plain)
    streamer = settings.last_streamer
    assert streamer.stats["demand_loads"] > 0 and info["step_cache"].last["cached_steps"] > 0


def _sdxl_like_unet():
    """ComfyUI's UNetModel with SDXL's extras (a label embedding of an adm vector, linear transformer projections)
    at a reduced size."""
    comfy_inproc.fixtures_module()
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    torch.manual_seed(0)
    unet = UNetModel(image_size=32, in_channels=4, out_channels=4, model_channels=64, num_res_blocks=[1, 1],
                     channel_mult=[1, 2], transformer_depth=[0, 1], transformer_depth_output=[0, 0, 1, 1],
                     transformer_depth_middle=1, num_head_channels=32, context_dim=96, use_spatial_transformer=True,
                     use_linear_in_transformer=True, num_classes="sequential", adm_in_channels=48,
                     dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for p in unet.parameters():
            p.normal_(0, 0.05)
    return unet.eval()


@current
@pytest.mark.parametrize("branch", [0, 2, 3])
def test_both_kinds_of_call_on_an_sdxl_like_unet_are_the_reference(branch):
    """The DIFFUSION_MODEL wrapper under ComfyUI's own UNetModel.forward, called as apply_model calls it."""
    import comfy.patcher_extension as pe
    from sd_accel.hosts.comfyui import step_cache as sc_host
    unet = _sdxl_like_unet()
    cache = sc_host.StepCache("interval 2", branch)
    g = torch.Generator().manual_seed(1)
    x, ctx, y = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 96, generator=g), torch.randn(2, 48, generator=g)
    t = torch.tensor([700.0, 700.0])
    wrappers = {pe.WrappersMP.DIFFUSION_MODEL: {sc_host.WRAPPER_KEY: [cache.diffusion_model]}}

    def call(mark, x):
        to = {"wrappers": wrappers, sc_host.CALL_OPTION: mark}
        return sc_host._keeping_feature(lambda: unet(x, t, context=ctx, y=y, transformer_options=to))()
    with torch.no_grad():
        out, feature = call(("full",), x)
        want, want_feature = reference.unet_call(unet, x, t, ctx, y, branch=branch)
        assert torch.equal(out, want) and torch.equal(feature, want_feature)
        x2 = x * 0.9
        got, none = call(("cached", feature), x2)
        assert none is None and torch.equal(got, reference.unet_call(unet, x2, t, ctx, y, feature=feature,
                                                                     branch=branch)[0])
        assert not torch.equal(got, reference.unet_call(unet, x2, t, ctx, y)[0])
