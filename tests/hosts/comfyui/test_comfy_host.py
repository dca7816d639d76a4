"""hosts/comfyui/accelerate.py on a real ComfyUI ModelPatcher, in-process (CPU): what it patches, how it wraps
the step, that the input model is untouched and that re-running a node hands back the same clone."""

import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def test_accelerate_patches_a_clone_and_leaves_the_input_alone(model):
    from sd_accel.hosts.comfyui import accelerate as host
    before = dict(model.object_patches)
    clone, info = host.accelerate(model, host.AccelOptions())
    assert clone is not model and model.object_patches == before
    assert info["patched"]["group_norm_silu"] > 0 and info["patched"]["geglu"] > 0
    assert all(k.startswith("diffusion_model.") for k in clone.object_patches)
    assert info["wrapper"] in ("apply_model wrapper (keyed)", "model_function_wrapper")


def test_same_input_and_options_give_the_same_clone(model):
    from sd_accel.hosts.comfyui import accelerate as host
    a, _ = host.accelerate(model, host.AccelOptions())
    b, _ = host.accelerate(model, host.AccelOptions())
    c, _ = host.accelerate(model, host.AccelOptions(cuda_graph=False))
    assert a is b, "a re-run must not make ComfyUI swap clones (it unloads the previous one)"
    assert c is not a
    other = model.clone()
    other.add_patches({"diffusion_model.out.2.weight": (torch.zeros(1),)}, 1.0)   # a different patch set
    d, _ = host.accelerate(other, host.AccelOptions())
    assert d is not a


def test_reapplying_on_an_accelerated_model_keeps_one_wrapper(model):
    from sd_accel.hosts.comfyui import accelerate as host, step_wrappers
    a, _ = host.accelerate(model, host.AccelOptions())
    b, _ = host.accelerate(a, host.AccelOptions())
    if hasattr(b, "wrappers"):
        import comfy.patcher_extension as pe
        assert len(b.wrappers[pe.WrappersMP.APPLY_MODEL][step_wrappers.WRAPPER_KEY]) == 1
    else:
        w = b.model_options["model_function_wrapper"]
        assert getattr(w, "sd_accel_prev", None) is None, "our own wrapper must not be chained to itself"
    assert set(b.object_patches) == set(a.object_patches)


def test_wrapper_chains_a_wrapper_another_pack_set(model):
    from sd_accel.hosts.comfyui import accelerate as host
    if hasattr(model, "add_wrapper_with_key"):
        pytest.skip("keyed wrappers on this host: nothing to chain")   # covered on ComfyUI 2024
    calls = []
    other = model.clone()

    def theirs(apply_model, a):
        calls.append(1)
        return apply_model(a["input"], a["timestep"], **a["c"])
    other.set_model_unet_function_wrapper(theirs)
    acc, info = host.accelerate(other, host.AccelOptions())
    assert info["wrapper"] == "model_function_wrapper (chained)"
    x = torch.randn(1, 4, 8, 8)
    seen = []
    out = acc.model_options["model_function_wrapper"](
        lambda x, t, **c: seen.append(t) or x * 2, {"input": x, "timestep": torch.ones(1), "c": {},
                                                    "cond_or_uncond": [0]})
    assert calls == [1] and len(seen) == 1 and torch.equal(out, x * 2)


def test_the_clone_cache_lets_an_unused_input_model_be_freed(model):
    """A model ComfyUI no longer holds (a LoRA variant, an old checkpoint) must not be kept alive by
    the cache of clones, nor keep its clone alive."""
    import gc
    import weakref
    from sd_accel.hosts.comfyui import accelerate as host
    other = model.clone()
    acc, _ = host.accelerate(other, host.AccelOptions())
    assert host.accelerate(other, host.AccelOptions())[0] is acc
    refs = weakref.ref(other), weakref.ref(acc)
    del other, acc
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def test_graph_state_does_not_keep_an_unloaded_checkpoint_alive(tmp_path):
    """Switching checkpoints must free the old UNet: the per-model graph state refers back to the model."""
    import gc
    import weakref
    from sd_accel.hosts.comfyui import accelerate as host
    m = comfy_inproc.tiny_model_patcher(tmp_path)
    acc, info = host.accelerate(m, host.AccelOptions())
    assert info.get("graph_state") is not None
    ref = weakref.ref(m.model)
    del m, acc, info
    gc.collect()
    assert ref() is None


def test_channels_last_transformer_stand_ins_patch_and_unpatch_in_order(model, monkeypatch):
    """On a GPU, channels_last adds SpatialTransformer stand-ins before the fused modules, so the fused norm is
    set inside the stand-in (CPU here: the GPU check is forced). Folded into one patch per top-level block,
    the original tree is never modified, not even while the clone is loaded; a plan made while another
    clone's patches are applied starts from the originals too, and nothing fused is left after unloading."""
    import comfy.model_management as mm
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    dm = model.model.diffusion_model
    path, st = next((n, m) for n, m in dm.named_modules() if type(m).__name__ == "SpatialTransformer")
    norm, block_cls = st.norm, type(st.transformer_blocks[0])
    acc, info = host.accelerate(model.clone(), host.AccelOptions())
    assert info["patched"]["channels_last_transformer"] >= 1
    folds = hasattr(model, "add_callback_with_key")    # current ComfyUI; 2024: module by module
    if folds:
        assert set(acc.object_patches) <= {"diffusion_model." + n for n in dm._modules}, list(acc.object_patches)
        assert info["object_patches"] == len(acc.object_patches) < sum(info["patched"].values())
    else:
        keys = list(acc.object_patches)
        assert keys.index("diffusion_model." + path) < keys.index("diffusion_model." + path + ".norm")
    mm.load_models_gpu([acc])
    live = dm.get_submodule(path)
    assert fm.kind_of(live) == "layout" and type(live) is type(st) and fm.is_fused(live.norm)
    assert live.proj_in is st.proj_in and live.norm.weight is norm.weight, "the stand-in shares the tensors"
    if folds:
        assert st.norm is norm and not fm.is_fused(st.norm), "the original block itself is never modified"
    # the next prompt's model is planned while this one is applied: another clone whose plan is its own (another
    # pack's object patch on it; a clone planned from the same inputs would get this one's modules: plan_reuse.py)
    other = model.clone().clone()
    other.add_object_patch("model_sampling", model.model.model_sampling)
    acc2, _ = host.accelerate(other, host.AccelOptions(channels_last=True, cuda_graph=False))
    mm.load_models_gpu([acc2])
    live2 = dm.get_submodule(path)
    assert fm.kind_of(live2) == "layout" and live2 is not live
    assert fm.is_fused(live2.transformer_blocks[0]) and fm.original_class(live2.transformer_blocks[0]) is block_cls
    mm.unload_all_models()
    assert dm.get_submodule(path) is st and st.norm is norm
    left = [n for n, m in dm.named_modules() if fm.is_fused(m)]
    assert not left, left


def _node_sample(model):
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        return SDAccelKSampler().sample(model, 3, 2, 5.0, "euler", "normal", cond, neg,
                                        {"samples": torch.zeros(1, 4, 8, 8)})


def test_a_run_that_compiled_kernels_ahead_says_so_and_a_warm_one_does_not(model, monkeypatch):
    """The report of a run on a cold Triton cache names the kernels compiled in parallel and their seconds
    (the first run's extra time); the compile counters are stood in for (on a GPU, run_compiling_ahead
    moves them; tests/gpu/test_compile_ahead_gpu.py)."""
    from sd_accel.engine.reports import run_report
    from sd_accel.kernels import _launch
    monkeypatch.setitem(_launch.first_launches, "ahead", 7)
    monkeypatch.setitem(_launch.first_launches, "ahead_seconds", 1.0)
    import importlib
    comfy_nodes = importlib.import_module("nodes")
    real = comfy_nodes.common_ksampler

    def cold(*a, **k):   # the run compiles 12 kernels in 3.5 s
        _launch.first_launches["ahead"] += 12
        _launch.first_launches["ahead_seconds"] += 3.5
        return real(*a, **k)
    monkeypatch.setattr(comfy_nodes, "common_ksampler", cold)
    notes = _node_sample(model)["ui"]["sdaccel_report"][0]["notes"]
    assert [n for n in notes if "compiled in parallel" in n] == [
        "first run of this shape: 12 Triton kernels compiled in parallel (3.5 s; kept in Triton's cache for "
        "later runs and starts)"]
    monkeypatch.setattr(comfy_nodes, "common_ksampler", real)
    assert not [n for n in _node_sample(model)["ui"]["sdaccel_report"][0]["notes"] if "compiled" in n]
    assert run_report.compile_note((5, 1.0), (5, 1.0)) is None


def test_another_packs_patch_under_a_block_keeps_that_block_unfolded_and_in_effect(model):
    """A patch the input model already has under input_blocks (another pack, upstream): ComfyUI applies it
    first, so a copy of input_blocks made now would hide it. That block is patched module by module, as before;
    the other blocks are folded, and the other pack's module runs in our patched UNet."""
    import comfy.model_management as mm
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.hosts.comfyui import accelerate as host
    dm = model.model.diffusion_model
    path, attn = next((n, m) for n, m in dm.named_modules() if n.startswith("input_blocks") and n.endswith("attn1"))
    theirs = model.clone()
    tag = comfy_inproc.TaggedModule(attn)
    theirs.add_object_patch("diffusion_model." + path, tag)
    acc, info = host.accelerate(theirs, host.AccelOptions(cuda_graph=False))
    keys = list(acc.object_patches)
    assert "diffusion_model.input_blocks" not in keys
    assert ("diffusion_model.output_blocks" in keys) == hasattr(model, "add_callback_with_key")
    assert keys[0] == "diffusion_model." + path, "theirs first, as they were added"
    assert any(k.startswith("diffusion_model.input_blocks.") and fm.is_fused(acc.object_patches[k]) for k in keys)
    _node_sample(acc)
    assert tag.calls > 0, "the other pack's module ran"
    mm.unload_all_models()
    assert dm.get_submodule(path) is attn and not [n for n, m in dm.named_modules() if fm.is_fused(m)]


def test_a_patch_set_inside_a_folded_block_later_is_undone_without_leaving_ours_in_the_original(model):
    """Apply SD Accel, then another pack's node patches a transformer block under a folded block: ComfyUI sets
    it inside our copy and restores patches in the order it applied them, which would put our stand-in into
    the original tree; before each run our blocks move to the end of that order (ON_PRE_RUN). ComfyUI 2024
    has no such callback: there nothing is folded, and the same run leaves the original tree clean too."""
    import importlib
    import comfy.model_management as mm
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.hosts.comfyui import accelerate as host
    dm = model.model.diffusion_model
    folds = hasattr(model, "add_callback_with_key")
    # where the hazard is: a module of ours inside the copy (current ComfyUI). Unfolded (2024), a later patch
    # replacing a module SD Accel patches inside cannot work (ComfyUI sets our children's patches through it):
    # there, one we do not patch inside
    kind = "BasicTransformerBlock" if folds else "CrossAttention"
    path, block = next((n, m) for n, m in dm.named_modules() if type(m).__name__ == kind)
    acc, _ = host.accelerate(model.clone(), host.AccelOptions(cuda_graph=False))
    folded = [k for k, m in acc.object_patches.items() if host.object_patches.is_folded(m)]
    assert bool(folded) == folds
    later = acc.clone()
    tag = comfy_inproc.TaggedModule(block)
    later.add_object_patch("diffusion_model." + path, tag)
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        importlib.import_module("nodes").common_ksampler(later, 3, 2, 5.0, "euler", "normal", cond, neg,
                                                         {"samples": torch.zeros(1, 4, 8, 8)})
    assert tag.calls > 0
    mm.unload_all_models()
    assert dm.get_submodule(path) is block
    assert not [n for n, m in dm.named_modules() if fm.is_fused(m)]


def test_two_clones_of_one_model_give_their_wrappers_the_same_graph_key(model):
    """ComfyUI passes a clone's wrappers and callbacks to the model in transformer_options, which is part of the
    CUDA-graph key: a LoRA variant (a new clone of the same model) must key them alike, or each one would start
    with an eager warm-up step instead of capturing at once (tests/gpu/test_graphs_gpu.py); other options must
    not (they compute other graphs)."""
    from sd_accel.engine.graphs import keys
    from sd_accel.hosts.comfyui import accelerate as host
    a_in, b_in = model.clone(), model.clone()
    b_in.add_patches({"diffusion_model.out.2.weight": (torch.zeros(1),)}, 1.0)
    a, _ = host.accelerate(a_in, host.AccelOptions())
    b, _ = host.accelerate(b_in, host.AccelOptions())
    c, _ = host.accelerate(b_in, host.AccelOptions(fused_kernels=False))
    assert a is not b
    for attr in ("wrappers", "callbacks"):
        got = [getattr(m, attr, None) for m in (a, b, c)]
        if got[0] is None:
            continue   # ComfyUI 2024: neither reaches transformer_options
        ours = [{k: {kk: fs for kk, fs in d.items() if "sd_accel" in kk} for k, d in g.items()} for g in got]
        ka, kb, kc = (keys.flatten(o).key for o in ours)
        assert ours[0] and ka == kb, attr
        assert any(ours[0][k] for k in ours[0]) and ka != kc, attr
