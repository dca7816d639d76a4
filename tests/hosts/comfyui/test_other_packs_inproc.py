"""Other packs' mechanisms (the stand-ins of tests/packs, docs/other_packs.md) in-process on the CPU, where a
test needs SD Accel's GPU plan: the channels_last stand-ins are planned only for a CUDA load device, so the
check is forced here as tests/hosts/comfyui/test_comfy_host.py does. The server tests (tests/server/test_other_packs.py)
cover the rest through a real ComfyUI."""
import importlib.util
import os
import sys

import pytest
import torch

import comfy_inproc

PACKS = os.path.join(comfy_inproc.REPO, "tests", "packs")


def _load_pack(name):
    """A stand-in pack imported as ComfyUI imports a custom-node folder (its __init__.py as a package)."""
    if name not in sys.modules:
        path = os.path.join(PACKS, name, "__init__.py")
        spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[os.path.dirname(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _sample_batch4(model):
    return comfy_inproc.sample_tiny(model, batch=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


def test_animatediff_places_its_modules_as_on_stock_with_our_gpu_layout_stand_ins(model, monkeypatch):
    """On a GPU, channels_last puts a SpatialTransformer stand-in (a subclass) in each block. AnimateDiff places
    its temporal module after the block's last `type(c) == SpatialTransformer` (an exact class test), else after
    the first ResBlock: with the stand-in in place it lands before the transformer, another network."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    ad = _load_pack("standin_animatediff")
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    animated = ad.ADLikeApplyMotion().apply(model, 5, "v2", 0, 4, "standard_uniform", "pyramid")[0]
    mm.unload_all_models()
    ours, info = host.accelerate(animated, host.AccelOptions(fused_kernels=False, cuda_graph=False))
    assert info["patched"].get("channels_last_transformer"), info["patched"]
    got = _sample_batch4(ours)
    mm.unload_all_models()
    ref = _sample_batch4(animated)
    mm.unload_all_models()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel


def test_the_gpu_layout_stand_ins_alone_match_stock_on_this_cpu(model, monkeypatch):
    """The control for the test above: without AnimateDiff the same forced plan gives stock's latent."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    mm.unload_all_models()
    ours, _ = host.accelerate(model.clone(), host.AccelOptions(fused_kernels=False, cuda_graph=False))
    got = _sample_batch4(ours)
    mm.unload_all_models()
    ref = _sample_batch4(model)
    mm.unload_all_models()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel


def _loaded_for_a_run(patcher):
    """The model loaded with its object patches applied, and the run's ON_PRE_RUN callbacks called, as ComfyUI's
    outer_sample does before the first step."""
    import comfy.model_management as mm
    mm.load_models_gpu([patcher])
    patcher.pre_run()
    return patcher.model


def test_no_forward_of_ours_counts_as_another_packs_hook(model, monkeypatch):
    """The check that keeps graphs off for a run with hooked layers must not fire on SD Accel's own stand-ins (bound
    mixin forwards, forward patches, folded copies): a false alarm would take every user's graphs away."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import hooked_layers
    if not hasattr(model, "add_callback_with_key"):
        pytest.skip("ComfyUI 2024 has no ON_PRE_RUN callbacks")
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    mm.unload_all_models()
    ours, info = host.accelerate(model.clone(), host.AccelOptions(fused_kernels=True))
    assert info["patched"].get("group_norm_silu") and info["patched"].get("channels_last_transformer"), info
    base = _loaded_for_a_run(ours)
    own = [n for n, m in base.diffusion_model.named_modules() if "forward" in m.__dict__]
    assert own, "the plan set no forward of its own: this test would not test the check"
    assert hooked_layers.run_reason(base) is None, hooked_layers.run_reason(base)
    mm.unload_all_models()


def test_blocks_hooked_before_the_load_get_their_originals_back_for_the_run(model, monkeypatch):
    """BrushNet hooks the layers in the tree when its run wrapper starts, before ComfyUI applies SD Accel's object
    patches: at ON_PRE_RUN our copies of the hooked blocks give way to the originals, and the run's line names the
    hooked layers (no graph). The next load of a clone without the hooks gets our copies back."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import hooked_layers
    if not hasattr(model, "add_callback_with_key"):
        pytest.skip("ComfyUI 2024 has no ON_PRE_RUN callbacks")
    bn = _load_pack("standin_brushnet")
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    mm.unload_all_models()
    ours, _ = host.accelerate(model.clone(), host.AccelOptions(fused_kernels=True))
    unet = ours.model.diffusion_model
    originals = {k: getattr(unet, k) for k in ("input_blocks", "middle_block", "output_blocks")}
    bn.set_hook(unet)        # what its OUTER_SAMPLE wrapper does, on the unpatched tree
    try:
        base = _loaded_for_a_run(ours)
        assert all(getattr(unet, k) is m for k, m in originals.items()), "a hooked block stayed our copy"
        why = hooked_layers.run_reason(base)
        assert why and "another pack set the forward of" in why and "give way" in why, why
    finally:
        bn.clean_hook(unet)
        mm.unload_all_models()
    # its unhook leaves each layer's own forward set on the instance: no hook, and no copy of ours may call the
    # original through it
    assert any("forward" in m.__dict__ for m in unet.modules())
    base = _loaded_for_a_run(host.accelerate(model.clone(), host.AccelOptions(fused_kernels=True))[0])
    assert hooked_layers.run_reason(base) is None
    assert any(getattr(unet, k) is not m for k, m in originals.items()), "our copies did not come back"
    bound_elsewhere = [n for n, m in unet.named_modules()
                       if getattr(m.__dict__.get("forward"), "__self__", m) is not m]
    assert not bound_elsewhere, bound_elsewhere
    mm.unload_all_models()


def test_a_fault_in_the_hooked_layers_check_costs_the_run_its_graphs_not_the_run(model, monkeypatch):
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import hooked_layers
    if not hasattr(model, "add_callback_with_key"):
        pytest.skip("ComfyUI 2024 has no ON_PRE_RUN callbacks")

    def broken(patcher, is_ours):
        raise RuntimeError("a module tree this check cannot read")
    monkeypatch.setattr(hooked_layers, "give_way", broken)
    monkeypatch.setattr(hooked_layers, "strict", lambda: False)
    mm.unload_all_models()
    base = _loaded_for_a_run(host.accelerate(model.clone(), host.AccelOptions(fused_kernels=False))[0])
    why = hooked_layers.run_reason(base)
    assert why and "failed (RuntimeError: a module tree this check cannot read): no graph" in why, why
    mm.unload_all_models()


# -- LayerDiffuse (huchenlei/ComfyUI-layerdiffuse): a forward wrapper on the block class, set at import ---------------

class _SharedAttentionLike(torch.nn.Module):
    """LayerDiffuse's attention-sharing unit as far as SD Accel meets it: an object patch in each attn1's place that
    reads the transformer_options its class-level wrapper recorded for the current block call (the step's sigmas),
    not the ones it is called with. Here: the attention's output scaled by the step's sigma."""
    recorded = {}

    def __init__(self, inner):
        super().__init__()
        self.inner = [inner]

    def forward(self, h, context=None, value=None, transformer_options=None):
        sigma = type(self).recorded["sigmas"].to(h).mean()
        return self.inner[0](h, context=context, value=value) * (1.0 + 0.05 * sigma)


def _record_block_options():
    """LayerDiffuse's `hijack_transformer_block`: BasicTransformerBlock.forward wrapped (functools.wraps), each call's
    transformer_options kept on the attention-sharing class."""
    import functools
    from comfy.ldm.modules.attention import BasicTransformerBlock
    original = BasicTransformerBlock.forward

    @functools.wraps(original)
    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's signature
        _SharedAttentionLike.recorded = transformer_options
        return original(self, x, context, transformer_options)
    return forward


def _stock_reference(model, patched, what):
    """Stock's latent for `patched` (a clone with another pack's patches), after checking that the patches change
    the image at all (otherwise a test of them could not fail)."""
    import comfy.model_management as mm
    mm.unload_all_models()
    plain = comfy_inproc.sample_tiny(model.clone(), steps=2, cfg=3.0)
    mm.unload_all_models()
    ref = comfy_inproc.sample_tiny(patched, steps=2, cfg=3.0)
    mm.unload_all_models()
    assert float((ref - plain).norm() / plain.norm()) > 1e-3, what + " changed nothing: no test"
    return ref


def test_a_block_forward_another_pack_wrapped_at_import_runs_and_the_image_is_stock(model, monkeypatch):
    """Before, the transformer-block stand-in skipped the wrapper (its source check read through it to ComfyUI's):
    the sharing units read the options of stock's last call, another image. The blocks stay the host's, the rest is
    fused, and the report says why."""
    import comfy.model_management as mm
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(BasicTransformerBlock, "forward", _record_block_options())
    shared = model.clone()
    unet = model.model.diffusion_model
    paths = [n for n, m in unet.named_modules() if n.endswith("transformer_blocks.0.attn1")]
    for path in paths:
        shared.add_object_patch("diffusion_model." + path, _SharedAttentionLike(unet.get_submodule(path)))
    ref = _stock_reference(model, shared, "the sharing units")
    ours, info = host.accelerate(shared, host.AccelOptions(cuda_graph=False))
    assert "transformer_add_norm" not in info["patched"] and info["patched"].get("resblock_add_norm"), info
    assert "BasicTransformerBlock.forward" in info["reasons"]["another pack's forwards"], info["reasons"]
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=3.0)
    mm.unload_all_models()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel


def _brushnet_inputs():
    image = torch.full((1, 64, 64, 3), 0.15)
    image[:, 16:40, 24:56] = torch.tensor([0.95, 0.75, 0.5])
    return image, image[..., 0].clone()


def _sample_brushnet(bn, patcher, vae):
    """Stock KSampler on `patcher` with the BrushNet stand-in applied (its conditioning as the pack returns it)."""
    import nodes
    g = torch.Generator().manual_seed(11)
    pos = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    image, mask = _brushnet_inputs()
    with torch.inference_mode():
        m, pos, neg, latent = bn.BrushNetLikeApply().model_update(patcher, vae, image, mask, pos, neg, 1.0, 0, 10000,
                                                                 "float32", 1)
        return nodes.KSampler().sample(m, 5, 3, 7.0, "euler", "normal", pos, neg, latent)[0]["samples"]


def _brushnet_reference(model, monkeypatch):
    """(BrushNet stand-in, VAE, stock's BrushNet latent on `model`) with SD Accel's GPU plan forced on this CPU;
    skips on ComfyUI 2024, which has none of the model wrappers BrushNet's current release hooks."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    if not hasattr(model, "add_callback_with_key"):
        pytest.skip("BrushNet's current release hooks ComfyUI's model wrappers, which ComfyUI 2024 does not have")
    bn = _load_pack("standin_brushnet")
    vae = comfy_inproc.tiny_vae()
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    mm.unload_all_models()
    return bn, vae, _sample_brushnet(bn, model.clone(), vae)


class _TreeSeen:
    """At each UNet call, the object-patch paths (as ComfyUI names them) where the tree holds a module or a forward of
    SD Accel's."""

    def __init__(self, unet):
        self.calls = []
        self.handle = unet.register_forward_pre_hook(lambda m, args: self.calls.append(_ours_paths(m)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _ours_paths(unet):
    from sd_accel.hosts.comfyui import object_patches
    out = []
    for n, m in unet.named_modules():
        if object_patches.is_ours(m):
            out.append("diffusion_model." + n)
        if object_patches.is_ours(m.__dict__.get("forward")):
            out.append("diffusion_model.%s.forward" % n)
    return out


def test_a_block_patched_module_by_module_gives_the_tree_back_after_the_run_and_brushnet_after_it_is_stock(
        model, monkeypatch):
    """Another pack's object patch under a block leaves that block patched module by module (a copy of it would hide
    the patch). At the run's end our stand-ins there leave the tree too, as the folded blocks do: else BrushNet,
    hooking the tree's layers before the next load, hooked our stand-ins, which that load (a stock KSampler's)
    replaced by the originals, and its samples on the output blocks were lost."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches
    bn, vae, want = _brushnet_reference(model, monkeypatch)
    unet = model.model.diffusion_model
    mm.unload_all_models()
    path = next(n for n, m in unet.named_modules() if n.startswith("output_blocks") and n.endswith(".emb_layers"))
    theirs = model.clone()
    tag = comfy_inproc.TaggedModule(unet.get_submodule(path))
    theirs.add_object_patch("diffusion_model." + path, tag)
    ours, _ = host.accelerate(theirs, host.AccelOptions(fused_kernels=False, cuda_graph=False))
    by_module = [k for k, v in ours.object_patches.items()
                 if k.startswith("diffusion_model.output_blocks.") and object_patches.is_ours(v)]
    assert by_module and "diffusion_model.output_blocks" not in ours.object_patches, "no block patched by module"
    for run in range(2):    # the second run's load sets them again
        with _TreeSeen(unet) as seen:
            comfy_inproc.sample_tiny(ours, steps=2, cfg=3.0)
        assert seen.calls and all(set(by_module) <= set(c) for c in seen.calls), (run, by_module, seen.calls[:1])
        assert not _ours_paths(unet), "SD Accel's stand-ins stayed in the tree after the run"
    assert tag.calls > 0
    got = _sample_brushnet(bn, model.clone(), vae)
    mm.unload_all_models()
    assert torch.equal(got, want), float((got - want).norm() / want.norm())


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["layout", "fused"])
@pytest.mark.parametrize("pack_first", [True, False], ids=["pack_then_ours", "ours_then_pack"])
def test_our_stand_ins_over_another_packs_module_leave_the_tree_after_the_run_and_brushnet_after_them_is_stock(
        model, monkeypatch, fused_kernels, pack_first):
    """On a GPU, channels_last's SpatialTransformer stand-ins (and, with fused kernels, the transformer blocks') stand
    over another pack's module at each first attn1 (an attention-sharing unit). Before, those stand-ins stayed in the
    tree after the run: put back alone, ComfyUI's next restore could set a module of our copy into the original.
    BrushNet, hooking the tree before the next load, then hooked them, and a stock KSampler's image after the run
    moved by 0.47 (latent rel. L2). Now every set under our stand-ins is undone too, last applied first: the pack's
    before ours (Apply SD Accel after it) or after ours (before it: its modules set inside our folded copies)."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches
    bn, vae, want = _brushnet_reference(model, monkeypatch)
    unet = model.model.diffusion_model
    options = host.AccelOptions(fused_kernels=fused_kernels, cuda_graph=False)
    units = []

    def add_pack(patcher):
        patcher = patcher.clone()
        for path in [n for n, m in unet.named_modules() if n.endswith("transformer_blocks.0.attn1")]:
            units.append(_ScaledOutput(unet.get_submodule(path)))
            patcher.add_object_patch("diffusion_model." + path, units[-1])
        return patcher

    ref = _stock_reference(model, add_pack(model), "the pack's modules")
    units.clear()
    ours = host.accelerate(add_pack(model), options)[0] if pack_first else add_pack(host.accelerate(model, options)[0])
    over = [k for k, v in ours.object_patches.items() if object_patches.is_ours(v) and
            any(t.startswith(k + ".") for t in object_patches.others_paths(ours))]
    assert over, "no stand-in of ours over the pack's modules: no test"
    for run in range(2):    # the second run's load sets ours and theirs again
        calls = sum(u.calls for u in units)
        with _TreeSeen(unet) as seen:
            got = comfy_inproc.sample_tiny(ours, steps=2, cfg=3.0)
        assert seen.calls and all(set(over) <= set(c) for c in seen.calls), (run, over, seen.calls[:1])
        assert sum(u.calls for u in units) > calls, "the pack's modules did not run"
        assert not _ours_paths(unet), "SD Accel's stand-ins stayed in the tree after the run"
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 1e-4, (run, rel)
    got = _sample_brushnet(bn, model.clone(), vae)
    mm.unload_all_models()
    assert torch.equal(got, want), float((got - want).norm() / want.norm())


def test_the_forward_patches_of_an_fp8_stored_unet_leave_after_the_run_and_brushnet_after_it_is_stock(
        tmp_path, monkeypatch):
    """An fp8-stored UNet's layers get SD Accel's forwards (object patches at `<layer>.forward`), its input conv among
    them, a layer BrushNet hooks. At the run's end they leave the tree with no bound forward of the layer left on it
    (a reference cycle), and their backup entries go too: ComfyUI's next load would otherwise set the layer's own
    forward again over BrushNet's hook."""
    checkpoint = comfy_inproc.tiny_checkpoint(tmp_path)   # ComfyUI on sys.path
    import comfy.model_management as mm
    import comfy.sd
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches
    if "model_options" not in comfy.sd.load_checkpoint_guess_config.__code__.co_varnames:
        pytest.skip("this ComfyUI (2024) cannot load weights as fp8 nor run BrushNet's current release")
    bn = _load_pack("standin_brushnet")
    vae = comfy_inproc.tiny_vae()
    with torch.inference_mode():
        model = comfy.sd.load_checkpoint_guess_config(
            checkpoint, output_vae=False, output_clip=False,
            model_options={"dtype": torch.float8_e4m3fn})[0]
    unet = model.model.diffusion_model
    mm.unload_all_models()
    want = _sample_brushnet(bn, model.clone(), vae)
    mm.unload_all_models()
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    ours, _ = host.accelerate(model.clone(), host.AccelOptions(fused_kernels=False, channels_last=False))
    forwards = [k for k, v in ours.object_patches.items() if object_patches.is_forward_patch(v)]
    assert "diffusion_model.input_blocks.0.0.forward" in forwards, forwards
    for run in range(2):    # the second run's load sets them again
        with _TreeSeen(unet) as seen:
            comfy_inproc.sample_tiny(ours, steps=2, cfg=3.0)
        assert seen.calls and all(set(forwards) <= set(c) for c in seen.calls), (run, seen.calls[:1])
        assert not _ours_paths(unet), "SD Accel's forwards stayed in the tree after the run"
    layers = [unet.get_submodule(k[len("diffusion_model."):-len(".forward")]) for k in forwards]
    assert not [m for m in layers if "forward" in m.__dict__], "a layer holds a forward of its own"
    assert not set(forwards) & set(ours.object_patches_backup), "their backup entries stayed"
    got = _sample_brushnet(bn, model.clone(), vae)
    mm.unload_all_models()
    assert torch.equal(got, want), float((got - want).norm() / want.norm())


class _ScaledOutput(comfy_inproc.TaggedModule):
    """Another pack's object patch: a module of its own in a UNet module's place, running it and scaling its output."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 1.5


@pytest.mark.parametrize("which", [".in_layers.0", ".in_layers.1", ".ff"])
def test_another_packs_module_where_sd_accel_would_set_its_own_runs_and_the_image_is_stock(model, which):
    """The plan is made on the unpatched blocks. Before, a patch of ours at the path of another pack's module
    (a ResBlock's GroupNorm, or its SiLU, GroupNorm+SiLU's pair) replaced that module, so it never ran (another
    image), and one under it (GEGLU's at `ff.net.0`) failed the run with AttributeError while ComfyUI set it
    through the pack's module. Now no patch of ours is at or under another pack's."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    unet = model.model.diffusion_model
    path = next(n for n, m in unet.named_modules() if n.startswith("output_blocks") and n.endswith(which))
    theirs = model.clone()
    scaled = _ScaledOutput(unet.get_submodule(path))
    theirs.add_object_patch("diffusion_model." + path, scaled)
    ref = _stock_reference(model, theirs, "the pack's module")
    ours, info = host.accelerate(theirs, host.AccelOptions(cuda_graph=False))
    assert ours.object_patches["diffusion_model." + path] is scaled
    assert not [k for k in ours.object_patches if k.startswith("diffusion_model." + path + ".")]
    assert info["patched"].get("group_norm_silu") or info["patched"].get("resblock_add_norm"), info["patched"]
    calls = scaled.calls
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=3.0)
    mm.unload_all_models()
    assert scaled.calls > calls, "the pack's module did not run"
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 1e-4, rel
