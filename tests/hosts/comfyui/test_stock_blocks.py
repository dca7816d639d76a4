"""hosts/comfyui/stock_blocks.py on a real ComfyUI, in-process (CPU): a stock-path call (the eager path a GPU's timing
picks where the host is the bound; held to it here, where the kernels' interpreter would pick the fused one) runs
the folded blocks' originals where the copies compute nothing else, the copies are back in the tree after it (and
the originals after the run), and the image is stock's; a block holding another pack's module, or host state the original lacks, keeps its copy."""
import importlib

import pytest
import torch

import comfy_inproc

FOLDED = ("input_blocks", "middle_block", "output_blocks", "out")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def stock_path(monkeypatch):
    from sd_accel.engine.graphs import eager
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")


def _sample(patcher, steps=3):
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        return importlib.import_module("nodes").common_ksampler(
            patcher, 5, steps, 5.0, "euler", "normal", cond, neg, {"samples": torch.zeros(1, 4, 8, 8)})[0]["samples"]


class _BlocksSeen:
    """Records, at each UNet call, the module at each top-level block name (a hook on the UNet itself, outside
    the blocks whose copies are compared)."""

    def __init__(self, unet):
        self.calls = []
        self.handle = unet.register_forward_pre_hook(
            lambda m, args: self.calls.append({n: m._modules.get(n) for n in FOLDED}))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_a_stock_path_call_runs_the_originals_of_the_folded_blocks_and_gives_stock_image(model):
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches
    dm = model.model.diffusion_model
    originals = {n: dm._modules[n] for n in FOLDED}
    # ours first, on a model stock has not loaded yet: the host's per-load attributes (`weight_function`) are then
    # on our copies' modules alone, as in a graph with no stock sampler
    acc, _ = host.accelerate(model.clone(), host.AccelOptions())
    folded = {k.split(".")[-1]: m for k, m in acc.object_patches.items() if object_patches.is_folded(m)}
    folds = hasattr(model, "add_callback_with_key")   # current ComfyUI folds; 2024 patches module by module
    assert bool(folded) == folds and set(folded) <= set(FOLDED)
    between = []    # the tree between the UNet's calls (after each step's CFG, outside the stock-path scope)
    acc.set_model_sampler_post_cfg_function(
        lambda args: between.append({n: dm._modules.get(n) for n in folded}) or args["denoised"])
    with _BlocksSeen(dm) as seen:
        ours = _sample(acc)
    assert seen.calls and between
    for blocks in seen.calls:
        for name in folded:
            assert blocks[name] is originals[name], "%s ran its copy on the stock path" % name
    for blocks in between:
        assert all(blocks[n] is m for n, m in folded.items()), "the copies are back in the tree after each call"
    # at the run's end the model's own blocks go back in the tree until its next load (originals_between_runs)
    assert all(dm._modules[n] is m for n, m in originals.items()), "the originals are in the tree between runs"
    mm.unload_all_models()
    assert all(dm._modules[n] is m for n, m in originals.items())
    assert torch.equal(ours, _sample(model))


def test_a_block_holding_another_packs_later_patch_keeps_its_copy_and_the_others_swap(model):
    """Another pack's object patch added after Apply SD Accel is set inside our copy (current ComfyUI): that
    block's original lacks it, so the block keeps the copy and the pack's module runs; the other blocks swap."""
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches
    dm = model.model.diffusion_model
    path, block = next((n, m) for n, m in dm.named_modules()
                       if n.startswith("output_blocks") and type(m).__name__ == "BasicTransformerBlock")
    acc, _ = host.accelerate(model.clone(), host.AccelOptions())
    if not any(object_patches.is_folded(m) for m in acc.object_patches.values()):
        assert not hasattr(model, "add_callback_with_key"), "only ComfyUI 2024 leaves every block unfolded"
        return
    later = acc.clone()
    tag = comfy_inproc.TaggedModule(block)
    later.add_object_patch("diffusion_model." + path, tag)
    theirs = model.clone()
    theirs.add_object_patch("diffusion_model." + path, comfy_inproc.TaggedModule(block))
    stock = _sample(theirs)
    with _BlocksSeen(dm) as seen:
        ours = _sample(later)
    assert tag.calls > 0, "the other pack's module ran"
    assert torch.equal(ours, stock)
    for blocks in seen.calls:
        assert object_patches.is_folded(blocks["output_blocks"])
        assert not object_patches.is_folded(blocks["input_blocks"])
    mm.unload_all_models()


def test_host_state_on_a_stand_in_alone_keeps_the_copy(model):
    """ComfyUI's low-VRAM load sets casting state on the modules in the tree (ours, while our copy is there):
    the original lacks it, so the copy stays. Equal values set on both (an emptied `weight_function`) do not
    count as a difference; a hook registered on a stand-in alone does."""
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import object_patches, stock_blocks
    acc, _ = host.accelerate(model.clone(), host.AccelOptions())
    copy = next((m for m in acc.object_patches.values() if object_patches.is_folded(m)), None)
    if copy is None:
        assert not hasattr(model, "add_callback_with_key")
        return
    original = object_patches._original(copy)
    assert stock_blocks.computes_as(copy, original)
    standin = next(m for m in copy.modules() if fm.kind_of(m) == "group_norm")
    base = next(o for o in original.modules()
                if type(o) is type(standin) and o._parameters is standin._parameters)
    standin.weight_function, base.weight_function = [], []
    assert stock_blocks.computes_as(copy, original)
    standin.comfy_cast_weights = True
    base.comfy_cast_weights = False
    assert not stock_blocks.computes_as(copy, original)
    base.comfy_cast_weights = True
    assert stock_blocks.computes_as(copy, original)
    handle = standin.register_forward_hook(lambda *a: None)
    assert not stock_blocks.computes_as(copy, original)
    handle.remove()
    assert stock_blocks.computes_as(copy, original)
    for m in (standin, base):
        for k in ("weight_function", "comfy_cast_weights"):
            m.__dict__.pop(k, None)


def test_the_swap_is_undone_when_the_call_raises():
    from sd_accel.hosts.comfyui import object_patches, stock_blocks
    unet, original = torch.nn.Module(), torch.nn.Sequential(torch.nn.Linear(2, 2))
    copy = torch.nn.Sequential()
    copy.__dict__.update(original.__dict__)
    copy.__dict__["_modules"] = dict(original._modules)
    copy.__dict__[object_patches._BASE] = original
    unet.blocks = copy
    blocks = stock_blocks.StockBlocks()
    blocks.enter_run(object())
    with pytest.raises(RuntimeError):
        with blocks.originals(unet) as n:
            assert n == 1 and unet.blocks is original
            raise RuntimeError("a step failed")
    assert unet.blocks is copy
    blocks.enter_run(None)
    with blocks.originals(unet) as n:
        assert n == 0 and unet.blocks is copy, "no run known: the copies stay"
