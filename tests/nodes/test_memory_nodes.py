"""nodes/memory_nodes.py (VRAM Pool) and hosts/comfyui/ (memory.py, memory_scopes.py, lowvram.py, clip_stage.py),
with the planner's run placement (engine/memory/vram_plan.py), called in-process on a real ComfyUI
ModelPatcher (CPU): a budget too small stops with the minimum needed, a valid budget gives the plan, ComfyUI's globals come back unchanged,
and on a ComfyUI with keyed sampler wrappers a real sampling run goes through the pool."""
import subprocess
import sys
import types

import pytest
import torch

import comfy_inproc
from refcount import no_garbage_collection

GIB = 2 ** 30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture()
def mm():
    import comfy.model_management as mm
    before = (getattr(mm, "EXTRA_RESERVED_VRAM", None), mm.vram_state, mm.minimum_inference_memory(),
              list(mm.current_loaded_models))
    yield mm
    after = (getattr(mm, "EXTRA_RESERVED_VRAM", None), mm.vram_state, mm.minimum_inference_memory(),
             list(mm.current_loaded_models))
    assert after[:3] == before[:3], "ComfyUI's memory globals must be restored"


def _node():
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    return SDAccelVRAMPool()


def _sizes(model):
    from sd_accel.engine.memory.stream_units import unet_block_sizes
    from sd_accel.hosts.comfyui.memory_scopes import diffusion_model
    return unet_block_sizes(diffusion_model(model))


def test_node_declares_category_description_and_tooltips():
    from sd_accel.nodes.memory_nodes import SDAccelVRAMPool
    from sd_accel.nodes import NODE_CLASS_MAPPINGS, LOAD_ERRORS
    assert "memory_nodes" not in LOAD_ERRORS and NODE_CLASS_MAPPINGS["SDAccelVRAMPool"] is SDAccelVRAMPool
    assert SDAccelVRAMPool.CATEGORY == "SD Accel/memory" and "VAE Decode (SD Accel)" in SDAccelVRAMPool.DESCRIPTION
    req = SDAccelVRAMPool.INPUT_TYPES()["required"]
    assert set(req) == {"model", "budget_gib", "offload", "release_cache", "expandable_segments"}
    assert all(v[1].get("tooltip") for v in req.values())
    opt = SDAccelVRAMPool.INPUT_TYPES()["optional"]
    assert set(opt) == {"clip"} and opt["clip"][0] == "CLIP" and opt["clip"][1]["tooltip"]
    assert SDAccelVRAMPool.RETURN_TYPES == ("MODEL", "CLIP") and len(SDAccelVRAMPool.OUTPUT_TOOLTIPS) == 2
    assert req["offload"][0] == ["none", "medvram", "lowvram"], "no option that does nothing yet may be offered"


def test_module_imports_without_comfyui():
    code = ("import sys, types; pkg = types.ModuleType('sd_accel'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['sd_accel'] = pkg; import sd_accel.nodes.memory_nodes as m; "
            "assert 'comfy' not in sys.modules; print(sorted(m.NODE_CLASS_MAPPINGS))")
    out = subprocess.run([sys.executable, "-c", code, comfy_inproc.REPO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SDAccelVRAMPool" in out.stdout


def test_budget_too_small_is_a_clear_error_before_sampling(model, mm):
    from sd_accel.hosts.comfyui.memory_scopes import activation_estimate
    from sd_accel.engine.memory.vram_plan import min_budget
    need = min_budget(_sizes(model), activation_estimate(mm, model), 0)   # without prefetch: the true floor
    with pytest.raises(ValueError) as ei:
        _node().apply(model, budget_gib=0.25)
    msg = str(ei.value)
    assert "VRAM budget 0.25 GiB is too small" in msg
    assert "at least %.2f GiB" % (need / GIB) in msg and "budget_gib" in msg


def test_a_budget_that_fits_one_streamed_block_runs_without_prefetch(model, mm):
    """Between the floor without prefetch and the floor with it, the node plans depth 0 and says so,
    rather than refusing a budget the model can run in (SDXL at 2 GiB on the H200 was refused)."""
    from sd_accel.hosts.comfyui.memory_scopes import activation_estimate
    from sd_accel.engine.memory.vram_plan import min_budget, plan_for_budget
    act = activation_estimate(mm, model)
    lo, hi = min_budget(_sizes(model), act, 0), min_budget(_sizes(model), act, 1)
    assert lo < hi
    plan, notes = plan_for_budget(_sizes(model), (lo + hi) // 2, act)
    assert plan.prefetch_depth == 0 and plan.peak_bytes <= (lo + hi) // 2
    assert notes and "prefetch off" in notes[0]
    plan, notes = plan_for_budget(_sizes(model), hi, act)
    assert plan.prefetch_depth == 1 and not notes


@pytest.mark.parametrize("bad", [dict(offload="novram"), dict(release_cache="always"), dict(budget_gib=-1.0)])
def test_bad_options_are_rejected(model, mm, bad):
    with pytest.raises(ValueError, match="VRAM Pool"):
        _node().apply(model, **bad)


def test_valid_budget_gives_the_plan_on_a_clone(model, mm):
    n_blocks = len(_sizes(model))
    before = dict(model.object_patches)
    out = _node().apply(model, budget_gib=8.0, offload="medvram", release_cache="after_run",
                        expandable_segments=True)
    clone = out["result"][0]
    assert clone is not model and model.object_patches == before
    (ui,) = out["ui"]["sdaccel_memory"]
    assert ui["resident_count"] == n_blocks and ui["streamed_count"] == 0
    assert 0 < ui["peak_gib"] < 8 and ui["budget_bytes"] == 8 * GIB
    (line,) = out["ui"]["text"]
    assert "%d blocks resident" % n_blocks in line and "offload medvram" in line
    if hasattr(model, "add_wrapper_with_key"):
        import comfy.patcher_extension as pe
        from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
        assert ui["enforced"] is True
        assert len(clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)) == 1
        assert not model.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    else:
        assert ui["enforced"] is False and "NOT enforced" in line


def test_budget_between_minimum_and_full_streams_some_blocks(model, mm):
    from sd_accel.hosts.comfyui.memory_scopes import activation_estimate
    from sd_accel.engine.memory.vram_plan import min_budget, plan_residency
    sizes, act = _sizes(model), activation_estimate(mm, model)
    budget = (min_budget(sizes, act, 1) + act + sum(s for _, s in sizes)) // 2
    out = _node().apply(model, budget_gib=budget / GIB)
    (ui,) = out["ui"]["sdaccel_memory"]
    ref = plan_residency(sizes, int(round(budget / GIB * GIB)), act, 1)
    assert ui["resident"] == ref.resident and ui["streamed"] == ref.streamed
    assert ui["resident_count"] > 0 and ui["streamed_count"] > 0
    assert ui["peak_bytes"] <= budget


def test_budget_scope_sets_and_restores_extra_reserved_vram():
    from sd_accel.hosts.comfyui.memory_scopes import budget_scope
    fake = types.SimpleNamespace(EXTRA_RESERVED_VRAM=400 * 2 ** 20)
    with pytest.raises(RuntimeError):
        with budget_scope(fake, 6 * GIB, 24 * GIB) as reserved:
            assert reserved == 18 * GIB and fake.EXTRA_RESERVED_VRAM == 18 * GIB
            raise RuntimeError("OOM")
    assert fake.EXTRA_RESERVED_VRAM == 400 * 2 ** 20
    with budget_scope(fake, 24 * GIB - 2 ** 20, 24 * GIB):   # never lowers the user's own reserve
        assert fake.EXTRA_RESERVED_VRAM == 400 * 2 ** 20


def test_run_in_pool_restores_globals_on_error_and_records_the_stage(model, mm):
    if not hasattr(mm, "EXTRA_RESERVED_VRAM"):
        pytest.skip("this ComfyUI has no EXTRA_RESERVED_VRAM: the budget is reported as not enforced")
    from sd_accel.hosts.comfyui.memory import PoolSettings, run_in_pool
    old = mm.EXTRA_RESERVED_VRAM
    s = PoolSettings(4 * GIB, "none", "after_run", False, None)
    seen = []

    from sd_accel.engine.graphs import eager

    def run():
        seen.append((mm.EXTRA_RESERVED_VRAM, mm.minimum_inference_memory(), eager._under_budget[0]))
        raise RuntimeError("CUDA out of memory (simulated)")
    with pytest.raises(RuntimeError, match="simulated"):
        run_in_pool(s, model, run, mm=mm, total_bytes=16 * GIB)
    assert seen[0][0] == 12 * GIB and seen[0][1] >= 12 * GIB   # the loader's reserve saw the budget
    assert seen[0][2] >= 1 and eager._under_budget[0] == 0   # no autotuning or compiling ahead under it
    assert mm.EXTRA_RESERVED_VRAM == old
    (stage,) = s.last_report["stages"]
    assert stage["stage"] == "sampling" and stage["error"] == "RuntimeError"
    assert "budget 4.00 GiB of 16.00 GiB" in s.last_notes and "cache released" in s.last_notes


def test_real_sampling_run_goes_through_the_pool(model, mm):
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    import comfy.sample
    from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
    import comfy.patcher_extension as pe
    clone = _node().apply(model, budget_gib=8.0, release_cache="after_run")["result"][0]
    settings = clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)[0].sd_accel_pool
    cond = [[torch.randn(1, 77, 768), {}]]
    latent = torch.zeros(1, 4, 8, 8)
    with torch.inference_mode():
        out = comfy.sample.sample(clone, torch.randn_like(latent), 1, 1.0, "euler", "normal", cond, cond, latent,
                                  seed=1)
    assert out.shape == latent.shape and torch.isfinite(out).all()
    assert settings.last_report["stages"][0]["stage"] == "sampling"
    assert "budget: not applied (the model runs on cpu)" in settings.last_notes


def test_medvram_unloads_others_before_and_the_model_after():
    """Against a stand-in model_management, on a (nominal) CUDA device: the order of the calls."""
    from sd_accel.hosts.comfyui.memory import PoolSettings, run_in_pool
    calls = []
    patcher = types.SimpleNamespace(load_device=torch.device("cuda", 0))
    ours, other = types.SimpleNamespace(model=patcher), types.SimpleNamespace(model=object())
    fake = types.SimpleNamespace(
        EXTRA_RESERVED_VRAM=0, current_loaded_models=[other, ours],
        get_total_memory=lambda dev: 24 * GIB,
        free_memory=lambda req, dev, keep_loaded=(): calls.append(("free", req, list(keep_loaded))),
        soft_empty_cache=lambda: calls.append(("empty",)))
    s = PoolSettings(0, "medvram", "after_run", False, None)
    assert run_in_pool(s, patcher, lambda: calls.append(("run", fake.EXTRA_RESERVED_VRAM)) or "latent",
                       mm=fake) == "latent"
    assert calls == [("free", 1e30, [ours]), ("run", 0), ("free", 1e30, []), ("empty",)]
    assert fake.EXTRA_RESERVED_VRAM == 0 and "cache released" in s.last_notes


def _pool(clone):
    import comfy.patcher_extension as pe
    from sd_accel.hosts.comfyui.memory import WRAPPER_KEY
    return clone.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)[0].sd_accel_pool


def _sample(patcher, seed=3):
    import comfy.sample
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    latent = torch.zeros(1, 4, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return comfy.sample.sample(patcher, noise, 2, 5.0, "euler", "normal", cond, neg, latent, seed=seed)


def _unet_state(model):
    """Parameter objects and hooks (not data pointers: a streamed tensor's host data moves into the streamer's
    buffer for good), and every parameter's values."""
    from sd_accel.hosts.comfyui.memory_scopes import diffusion_model
    unet = diffusion_model(model)
    return ([(n, id(p), p.device, p.dtype, tuple(p.shape)) for n, p in unet.named_parameters()],
            sum(len(m._forward_pre_hooks) for m in unet.modules()),
            {n: p.detach().clone() for n, p in unet.named_parameters()})


def _same_state(a, b):
    return a[:2] == b[:2] and a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_lowvram_on_cpu_says_streaming_is_off(model, mm):
    out = _node().apply(model, budget_gib=8.0, offload="lowvram")
    (ui,) = out["ui"]["sdaccel_memory"]
    (line,) = out["ui"]["text"]
    assert ui["offload"] == "lowvram" and ui["streaming"] is False
    if hasattr(model, "add_wrapper_with_key"):
        assert "lowvram: block streaming off (the model runs on cpu, streaming needs a CUDA device)" in line
    else:
        assert "NOT enforced" in line and "lowvram: block streaming off (this ComfyUI has no" in line


def test_lowvram_run_on_cpu_falls_back_with_the_same_result(model, mm):
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    ref = _sample(model)
    clone = _node().apply(model, budget_gib=8.0, offload="lowvram")["result"][0]
    assert torch.equal(_sample(clone), ref)
    notes = _pool(clone).last_notes
    assert any(n.startswith("lowvram: off (the model runs on cpu") for n in notes), notes


def test_lowvram_streams_every_block_inside_a_real_sampling_run(model, mm):
    """stream_every_block: the streamer runs inside ComfyUI's sampler (SAMPLER_SAMPLE wrapper) with real copies."""
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    ref = _sample(model)
    clone = _node().apply(model, budget_gib=8.0, offload="lowvram")["result"][0]
    settings = _pool(clone)
    settings.stream_every_block = True
    before = _unet_state(clone)
    out = _sample(clone)
    assert torch.equal(out, ref)
    assert _same_state(_unet_state(clone), before)            # Parameters, values and hooks as they were
    streamer = settings.last_streamer
    # the host data of the streamed weights now lives in the pool's buffers, not beside them
    spans = [(f.data_ptr(), f.data_ptr() + f.numel()) for f in settings.pinned_cache.values()]
    from sd_accel.hosts.comfyui.memory_scopes import diffusion_model
    assert spans and all(any(lo <= p.data_ptr() < hi for lo, hi in spans)
                         for p in diffusion_model(clone).parameters())
    n = len(streamer.blocks)
    assert not streamer.installed and streamer.stats["steps"] >= 2
    assert ("lowvram: %d of %d blocks streamed" % (n, n)) in " ".join(settings.last_notes)
    names = [b for b, _ in streamer.blocks]
    # every forward: the first two blocks' copies when it starts, then each block's while the one before the
    # block before it computes (prefetch depth 1)
    step = [(names[0], None), (names[1], None)] + [(names[j], names[j - 1]) for j in range(2, n)]
    assert streamer.prefetch_log[:n] == step and streamer.prefetch_log[n:2 * n] == step
    assert settings.active is None


def _oom_once(clone, mm, count=1):
    import comfy.patcher_extension as pe
    fired = []

    def raiser(executor, *a, **kw):
        if len(fired) < count:
            fired.append(1)
            raise mm.OOM_EXCEPTION("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return executor(*a, **kw)
    clone.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "test_oom", raiser)
    return fired


def test_out_of_memory_in_a_real_run_is_retried_once(model, mm):
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    ref = _sample(model)
    clone = _node().apply(model, budget_gib=8.0, release_cache="after_run")["result"][0]
    fired = _oom_once(clone, mm)
    out = _sample(clone)
    assert fired == [1] and torch.equal(out, ref)
    settings = _pool(clone)
    stages = settings.last_report["stages"]
    assert [s["stage"] for s in stages] == ["sampling", "sampling (retry)"]
    assert stages[0]["error"] == mm.OOM_EXCEPTION.__name__ and stages[1]["error"] is None
    (what,) = [n for n in settings.last_notes if n.startswith("out of memory")]
    assert "budget 8.00 GiB, offload none" in what and "retried once" in what and "injected" in what


def test_out_of_memory_twice_is_a_clear_error(model, mm):
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    clone = _node().apply(model, budget_gib=8.0)["result"][0]
    fired = _oom_once(clone, mm, count=2)
    with pytest.raises(RuntimeError) as ei:
        _sample(clone)
    assert len(fired) == 2
    msg = str(ei.value)
    assert msg.startswith("VRAM Pool: out of memory twice: at budget 8.00 GiB with offload none")
    assert "budget_gib" in msg and "minimum for this model is" in msg
    assert isinstance(ei.value.__cause__, mm.OOM_EXCEPTION)
    assert _pool(clone).active is None


def test_retry_goes_to_lowvram_at_half_the_budget_where_streaming_runs():
    """Against a stand-in model_management on a (nominal) CUDA device: what the retry asks for."""
    from sd_accel.hosts.comfyui.memory import PoolSettings, run_in_pool
    from sd_accel.engine.memory.vram_plan import plan_residency
    seen = []
    patcher = types.SimpleNamespace(load_device=torch.device("cuda", 0), add_wrapper_with_key=lambda *a: None)
    fake = types.SimpleNamespace(
        EXTRA_RESERVED_VRAM=0, extra_reserved_memory=lambda: fake.EXTRA_RESERVED_VRAM, current_loaded_models=[],
        get_total_memory=lambda dev: 24 * GIB, OOM_EXCEPTION=torch.cuda.OutOfMemoryError,
        free_memory=lambda req, dev, keep_loaded=(): seen.append(("free", req)),
        soft_empty_cache=lambda: seen.append(("empty",)))
    sizes = [("a", GIB // 4), ("b", GIB // 2), ("c", GIB // 4), ("d", GIB)]
    plan = plan_residency(sizes, 4 * GIB, GIB // 2)
    s = PoolSettings(4 * GIB, "none", "never", False, plan)
    retries = []

    def run():
        seen.append(("run", s.active.offload, s.active.placement.budget_bytes, fake.EXTRA_RESERVED_VRAM))
        if len(seen) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return "latent"
    assert run_in_pool(s, patcher, run, mm=fake, before_retry=lambda: retries.append(1)) == "latent"
    assert retries == [1]
    assert seen[0] == ("run", "none", 4 * GIB, 20 * GIB)
    assert seen[1:3] == [("free", 1e30), ("empty",)]
    at3 = plan_residency(sizes, 2 * GIB, GIB // 2)
    window = at3.peak_bytes - at3.activation_bytes - at3.resident_bytes
    assert plan.streamed == [] and at3.streamed and window > 0
    assert seen[3] == ("run", "lowvram", 2 * GIB,
                       24 * GIB - (2 * GIB - window))     # the loader gets the budget less the streaming window
    assert fake.EXTRA_RESERVED_VRAM == 0 and s.active is None


def test_activation_estimate_is_comfyuis_capped_at_its_reserve(model, mm):
    from sd_accel.hosts.comfyui.memory_scopes import activation_bytes, activation_estimate
    est = activation_estimate(mm, model)
    assert 0 < est <= activation_bytes(mm)
    assert est == min(activation_bytes(mm), int(model.model.memory_required([2, 4, 64, 64])))


def test_a_promoted_block_put_back_keeps_the_runs_channels_last_layout():
    """(resident_blocks moves tensors between devices, which needs a GPU; its put-back step is tested here.)"""
    from sd_accel.engine.memory.promoted_blocks import put_back as _put_back
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
    host = w.data
    w.data = host.clone().contiguous(memory_format=torch.channels_last)    # the run's converted GPU copy
    _put_back(w, host)
    assert w.is_contiguous(memory_format=torch.channels_last) and torch.equal(w, host)
    b = torch.nn.Parameter(torch.randn(8))
    bhost = b.data
    b.data = bhost.clone()
    _put_back(b, bhost)
    assert b.data_ptr() == bhost.data_ptr()


def test_lowvram_streaming_under_the_accelerated_patches_gives_the_stock_image(model, mm):
    """VRAM Pool lowvram and SD Accel's patches on one model, as a workflow chains them (pool -> Accelerated
    KSampler): the streamer hooks the patched modules (fused stand-ins, same Parameter objects) and the image
    is stock's. On CPU the kernels fall back and no graph runs; tests/gpu covers graphs + ring on a GPU."""
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    from sd_accel.hosts.comfyui import accelerate as host
    opts = host.AccelOptions(True, True, True, "auto")
    ref = _sample(model)
    plain = _sample(host.accelerate(model, opts)[0])     # the same patches without the pool
    clone = _node().apply(model, budget_gib=8.0, offload="lowvram")["result"][0]
    settings = _pool(clone)
    settings.stream_every_block = True
    patched, info = host.accelerate(clone, opts)
    out = _sample(patched)
    assert torch.equal(out, plain)                       # streaming changes no bit of the patched path
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)   # the patches' own fp32 reordering
    streamer = settings.last_streamer
    n = len(streamer.blocks)
    assert ("lowvram: %d of %d blocks streamed" % (n, n)) in " ".join(settings.last_notes)
    assert streamer.stats["copies"] >= 2 * n and not streamer.installed
    # the streamer saw the stand-ins: the blocks it streamed are the ones the patched forward ran (after the run the
    # model's own blocks are back in the tree: restore_order.originals_between_runs)
    stand_ins = [m for _, mods in streamer.blocks for unit in mods for m in unit.modules()
                 if getattr(m, "sdaccel_kind", None)]
    assert stand_ins, "the streamed blocks carry no fused stand-ins"


def test_host_copies_arm_the_pooled_model_and_the_models_loaded_on_its_device():
    """mirror_models against a stand-in model_management: the pooled model and the models ComfyUI has loaded
    on the same device are mirrored (their .to(cpu) goes through engine/memory/host_mirror.py), once each; a model
    on another device and non-modules are left alone; on the CPU nothing is."""
    from sd_accel.engine.memory import host_mirror
    from sd_accel.hosts.comfyui.memory_scopes import mirror_models
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    unet, te, vae, elsewhere = (torch.nn.Linear(2, 2) for _ in range(4))
    patcher = types.SimpleNamespace(model=unet, load_device=cuda0)
    loaded = [types.SimpleNamespace(device=cuda0, model=patcher),
              types.SimpleNamespace(device=cuda0, model=types.SimpleNamespace(model=te)),
              types.SimpleNamespace(device=cuda0, model=types.SimpleNamespace(model=vae)),
              types.SimpleNamespace(device=cuda1, model=types.SimpleNamespace(model=elsewhere)),
              types.SimpleNamespace(device=cuda0, model=None)]
    fake = types.SimpleNamespace(current_loaded_models=loaded)
    try:
        assert "off" in mirror_models(fake, patcher, torch.device("cpu"))
        assert host_mirror.mirror_of(unet) is None
        note = mirror_models(fake, patcher, cuda0)
        assert note.startswith("host copies: 3 models mirrored"), note
        assert all(host_mirror.mirror_of(m) is not None for m in (unet, te, vae))
        assert host_mirror.mirror_of(elsewhere) is None
        first = host_mirror.mirror_of(te)
        mirror_models(fake, patcher, cuda0)
        assert host_mirror.mirror_of(te) is first          # armed once
    finally:
        for m in (unet, te, vae, elsewhere):
            host_mirror.disarm(m)


class _FakeClip:
    """What the pool's clip wrapper needs of ComfyUI's CLIP: clone(), encode_from_tokens(), patcher.load_device.
    Each encode records the loader's reserve (`mm.EXTRA_RESERVED_VRAM`) at the time it runs."""

    def __init__(self, device, seen, mm=None):
        self.patcher = types.SimpleNamespace(load_device=device)
        self.seen, self.mm = seen, mm

    def clone(self):
        return _FakeClip(self.patcher.load_device, self.seen, self.mm)

    def encode_from_tokens(self, tokens, return_pooled=False):
        self.seen.append((tokens, return_pooled, getattr(self.mm, "EXTRA_RESERVED_VRAM", None)))
        return ("cond", tokens)


def test_pool_clip_encodes_under_the_budget_and_keeps_the_text_stage():
    """Against a stand-in model_management on a (nominal) CUDA device: during the encode ComfyUI's loader sees
    only the budget (24 GiB card, 4 GiB budget: 20 GiB reserved), restored after; the CLIP given is untouched;
    the stage is kept for the next sampling run's report."""
    from sd_accel.hosts.comfyui.clip_stage import pool_clip
    from sd_accel.hosts.comfyui.memory import PoolSettings
    seen = []
    fake = types.SimpleNamespace(EXTRA_RESERVED_VRAM=0, extra_reserved_memory=lambda: 0,
                                 get_total_memory=lambda dev: 24 * GIB)
    clip = _FakeClip(torch.device("cuda", 0), seen, fake)
    s = PoolSettings(4 * GIB, "lowvram", "never", False, None)
    pooled = pool_clip(clip, s, mm=fake)
    assert pooled is not clip and "encode_from_tokens" not in vars(clip)
    assert pooled.encode_from_tokens(["tok"], return_pooled=True) == ("cond", ["tok"])
    assert seen == [(["tok"], True, 20 * GIB)]
    assert fake.EXTRA_RESERVED_VRAM == 0
    assert s.text_stage["stage"] == "text encode"
    assert s.text_notes == ["text encode under the budget (4.00 GiB)"]
    clip.encode_from_tokens(["plain"])                # the CLIP given still encodes the stock way
    assert seen[-1] == (["plain"], False, 0)


def test_the_pools_clip_clone_is_freed_without_a_garbage_collection():
    """The wrapper is an attribute of the clone it wraps: it must not refer back to it (a cycle kept the text
    encoder of a checkpoint the user dropped in VRAM until a garbage collection ran; tests/gpu found it)."""
    import weakref
    comfy_inproc.fixtures_module()      # ComfyUI importable
    from sd_accel.hosts.comfyui.clip_stage import pool_clip
    from sd_accel.hosts.comfyui.memory import PoolSettings
    seen = []
    pooled = pool_clip(_FakeClip(torch.device("cpu"), seen), PoolSettings(0, "lowvram", "never", False, None))
    assert pooled.encode_from_tokens(["tok"]) == ("cond", ["tok"]) and seen == [(["tok"], False, None)]
    ref = weakref.ref(pooled)
    with no_garbage_collection():
        del pooled
        assert ref() is None, "the pool's CLIP clone outlived its last reference"


def test_the_clip_output_without_a_clip_input_says_what_to_connect(model, mm):
    out = _node().apply(model, budget_gib=8.0)
    clone, clip_out = out["result"]
    with pytest.raises(AttributeError, match="nothing is connected to its clip input"):
        clip_out.tokenize("a cat")
    import copy
    assert not hasattr(clip_out, "patcher") and copy.deepcopy(clip_out) is not None   # probes stay harmless
    assert out["ui"]["sdaccel_memory"][0]["clip"] is False


def test_text_stage_joins_the_next_sampling_runs_report(model, mm):
    if not hasattr(model, "add_wrapper_with_key"):
        pytest.skip("no keyed sampler wrappers on this ComfyUI")
    seen = []
    out = _node().apply(model, budget_gib=8.0, clip=_FakeClip(torch.device("cpu"), seen))
    clone, clip_out = out["result"]
    assert "clip: text encode under the pool" in out["ui"]["text"][0]
    clip_out.encode_from_tokens(["a"])
    clip_out.encode_from_tokens(["b"])
    assert len(seen) == 2
    _sample(clone)
    s = _pool(clone)
    stages = [st["stage"] for st in s.last_report["stages"]]
    assert stages == ["text encode", "sampling"], s.last_report
    assert s.text_stage is None
    _sample(clone)                                  # no encode since: the report has the sampling stage only
    assert [st["stage"] for st in s.last_report["stages"]] == ["sampling"]
