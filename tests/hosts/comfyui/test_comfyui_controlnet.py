"""ControlNet patching through ComfyUI's own objects, in-process: a random SD1.5 ControlNet (tiny preset)
loaded with `comfy.controlnet.load_controlnet`, run through `ControlNet.get_control` with the fused kernels
under the Triton interpreter. Runs against $SDACCEL_COMFYUI (current ComfyUI) or the 2024 one."""
import inspect
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sd_accel.engine.patches import fused_modules as fm
from sd_accel.engine.patches import hint_cache
from sd_accel.engine.reports import kernel_report

import comfy_inproc

REPO = comfy_inproc.REPO
HOME = os.environ.get("SDACCEL_HOME", os.path.expanduser("~/.cache/sd_accel"))
COMFY = os.environ.get("SDACCEL_COMFYUI") or os.path.join(HOME, "ComfyUI-2024")


class _Sampling:
    """What get_control needs from model_sampling: identity timestep and input scaling."""

    def timestep(self, t):
        return t

    def calculate_input(self, t, x):
        return x


@pytest.fixture(scope="module")
def comfy_cn(tmp_path_factory):
    if not os.path.isfile(os.path.join(COMFY, "main.py")):
        pytest.fail("no ComfyUI at %s: run dev/setup_env.sh" % COMFY)
    sys.path.insert(0, os.path.join(REPO, "dev"))
    import fixtures
    fixtures._import_comfy(COMFY)
    import comfy.controlnet
    from sd_accel.hosts.comfyui import controlnet as host_cn
    path = str(tmp_path_factory.mktemp("cn") / "cn15_tiny.safetensors")
    fixtures.build_controlnet(COMFY, "tiny", path, seed=3)

    def load():
        return comfy.controlnet.load_controlnet(path)
    return load, host_cn


@pytest.fixture(autouse=True)
def _unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _hint(seed, hw=32):
    return torch.rand(1, 3, hw, hw, generator=torch.Generator().manual_seed(seed))


def _inputs(hw=4):
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 4, hw, hw, generator=g), torch.tensor([700.0, 700.0]), torch.randn(2, 7, 768, generator=g)


def _control(cn, x, t, ctx):
    """One step's ControlNet residuals, the way ComfyUI's sampler asks for them (cond + uncond batch)."""
    import comfy.model_management as mm
    mm.load_models_gpu(cn.get_models())
    link = cn
    while link is not None:
        link.model_sampling_current = _Sampling()
        link = link.previous_controlnet
    kw = {"transformer_options": {}} if "transformer_options" in inspect.signature(cn.get_control).parameters else {}
    with torch.inference_mode():
        out = cn.get_control(x, t, {"c_crossattn": ctx}, 2, **kw)
    return [v for k in ("input", "middle", "output") for v in out[k] if v is not None]


def _applied(cn):
    """With a ControlNet's patcher loaded: the fused and caching modules now in its cldm module."""
    return {n: m for n, m in cn.control_model.named_modules() if fm.is_fused(m)}


def _rel(a, b):
    return max(float((x - y).norm() / y.norm().clamp_min(1e-12)) for x, y in zip(a, b))


def test_patched_controlnet_matches_stock_and_removal_restores(comfy_cn):
    load, host_cn = comfy_cn
    stock = load().copy().set_cond_hint(_hint(1), 0.8)
    cm = stock.control_model
    modules_before = dict(cm.named_modules())
    names_before = [n for n, _ in cm.named_parameters()]
    x, t, ctx = _inputs()
    ref = _control(stock, x, t, ctx)
    stock.cleanup()

    fast, info = host_cn.accelerate_controlnet(stock)
    assert fast is not stock and fast.control_model is cm, "a copy over the same weights"
    assert fast.control_model_wrapped is not stock.control_model_wrapped
    assert not stock.control_model_wrapped.object_patches, "the original ControlNet is not patched"
    assert info["controlnets"] == 1 and info["patched"]["hint_cache"] == 1
    assert info["patched"]["group_norm_silu"] >= 4 and info["patched"]["geglu"] >= 1
    assert fast.strength == 0.8 and fast.cond_hint_original is stock.cond_hint_original
    assert not _applied(fast), "nothing changes until ComfyUI loads the patcher"

    k0 = kernel_report.snapshot()
    out = _control(fast, x, t, ctx)
    ran = kernel_report.summarize(k0, kernel_report.snapshot())
    applied = _applied(fast)
    assert fm.kind_of(cm.input_hint_block) == "hint_cache"
    keys = fast.control_model_wrapped.object_patches.keys()
    assert all(any(n == k or n.startswith(k + ".") for k in keys) for n in applied), "each under its patch"
    assert len(keys) < len(applied), "folded: fewer patches than modules swapped"
    assert [n for n, _ in cm.named_parameters()] == names_before, "parameter names are unchanged"
    assert ran["group_norm_silu"]["fused"] > 0 and ran["geglu"]["fused"] > 0
    assert all(e["fallback"] == 0 for e in ran.values()), ran
    assert len(out) == len(ref) and _rel(out, ref) < 1e-4, _rel(out, ref)
    assert host_cn.hint_stats(info) == {"hits": 0, "misses": 1}

    # loading the stock ControlNet again (another prompt) takes the patches off: ComfyUI's own unpatch
    again = _control(stock, x, t, ctx)
    assert not _applied(stock)
    assert dict(cm.named_modules()).keys() == modules_before.keys()
    assert all(cm.get_submodule(n) is m for n, m in modules_before.items() if n)
    assert all(torch.equal(a, b) for a, b in zip(again, ref))


def test_hint_block_runs_once_per_hint_and_invalidates_on_a_new_hint(comfy_cn):
    load, host_cn = comfy_cn
    stock = load().copy().set_cond_hint(_hint(1), 1.0)
    fast, info = host_cn.accelerate_controlnet(stock, host_cn.ControlNetOptions(fused_kernels=False))
    assert info["patched"] == {"hint_cache": 1}
    x, t, ctx = _inputs()
    steps = [_control(fast, x, t + 100.0 * i, ctx) for i in range(3)]
    assert host_cn.hint_stats(info) == {"hits": 2, "misses": 1}
    for i, got in enumerate(steps):   # exact: the hint block's output does not depend on the step
        want = _control(stock, x, t + 100.0 * i, ctx)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
    stock.cleanup()

    # a new hint (a new image, or the next sampling run: ComfyUI rebuilds cond_hint) is recomputed
    fast.cleanup()
    fast.set_cond_hint(_hint(2), 1.0)
    new = _control(fast, x, t, ctx)
    assert host_cn.hint_stats(info) == {"hits": 2, "misses": 2}
    stock2 = stock.copy().set_cond_hint(_hint(2), 1.0)
    want = _control(stock2, x, t, ctx)
    assert all(torch.equal(a, b) for a, b in zip(new, want))
    assert not all(torch.equal(a, b) for a, b in zip(new, steps[0]))
    host_cn.release(info)
    assert not any(m._sdaccel_entries for m in info["hint_caches"]), "release drops the cached features"


def test_conds_chains_and_identity(comfy_cn):
    load, host_cn = comfy_cn
    base = load()
    other = load()                                    # a second ControlNet file
    first = base.copy().set_cond_hint(_hint(1), 1.0)
    second = other.copy().set_cond_hint(_hint(2), 0.5)
    second.set_previous_controlnet(first)             # what two chained Apply ControlNet nodes build
    ctx = torch.zeros(1, 7, 768)
    positive = [[ctx, {"control": second, "pooled_output": None}]]
    negative = [[ctx, {"control": second}]]
    # hint cache only: the fused kernels are checked above and are slow under the interpreter
    pos, neg, info = host_cn.accelerate_conds(positive, negative, host_cn.ControlNetOptions(fused_kernels=False))
    assert positive[0][1]["control"] is second and negative[0][1]["control"] is second, "inputs untouched"
    head = pos[0][1]["control"]
    assert head is neg[0][1]["control"], "one copy for both: ComfyUI batches cond and uncond by identity"
    assert head is not second and head.previous_controlnet is not first
    assert head.previous_controlnet.control_model is first.control_model
    assert info["controlnets"] == 2 and info["patched"]["hint_cache"] == 2
    assert pos[0][1]["pooled_output"] is None and pos[0][0] is ctx
    x, t, c = _inputs()
    ref = _control(second, x, t, c)
    out = _control(head, x, t, c)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    line = host_cn.summary(info)
    assert line.startswith("controlnet: 2 patched") and "hint block computed 2" in line


def test_options_off_and_foreign_links(comfy_cn):
    load, host_cn = comfy_cn
    import comfy.controlnet
    cn = load().copy()
    same, info = host_cn.accelerate_controlnet(cn, host_cn.ControlNetOptions(fused_kernels=False, hint_cache=False))
    assert same is cn and info["controlnets"] == 0

    class OtherPack(comfy.controlnet.ControlNet):     # another pack's subclass: left stock
        pass
    foreign = OtherPack(cn.control_model, load_device=cn.load_device)
    foreign.set_previous_controlnet(cn)
    new, info = host_cn.accelerate_controlnet(foreign)
    assert new is foreign and foreign.previous_controlnet is cn
    assert "OtherPack is not a full ControlNet" in info["skipped"]
    assert host_cn.summary(info).startswith("controlnet: 1 patched")


def test_graphed_forward_matches_stock_survives_prompts_and_unpatches(comfy_cn):
    """cuda_graph + channels_last on a ControlNet: its forward becomes the graph stand-in (eager on CPU,
    where no graph can be captured), the output is stock's, the hint block is not cached (a replay cannot
    take that Python-side decision), the stand-in is the same object on the next prompt (its graphs
    survive) and loading the stock ControlNet puts the class's own forward back."""
    from sd_accel.engine.graphs.graphed_forward import GraphedForward
    load, host_cn = comfy_cn
    stock = load().copy().set_cond_hint(_hint(2), 0.7)
    cm = stock.control_model
    x, t, ctx = _inputs()
    ref = _control(stock, x, t, ctx)
    opts = host_cn.ControlNetOptions(fused_kernels=True, cuda_graph=True, channels_last=True)
    fast, info = host_cn.accelerate_controlnet(stock, opts)
    assert info["patched"]["cuda_graph"] == 1 and "hint_cache" not in info["patched"]
    out = _control(fast, x, t, ctx)
    assert isinstance(cm.__dict__.get("forward"), GraphedForward)
    assert _rel(out, ref) < 1e-4, _rel(out, ref)
    gf = cm.forward
    assert gf.graphs.stats["eager"] >= 1 and gf.graphs.last_eager_reason == "no CUDA device"
    assert host_cn.graph_stats(info)["eager"] >= 1
    fast2, info2 = host_cn.accelerate_controlnet(stock, opts)   # the next prompt
    _control(fast2, x, t, ctx)
    assert cm.forward is gf, "one stand-in per ControlNet and options: its graphs are reused"
    again = _control(stock, x, t, ctx)
    assert not isinstance(cm.forward, GraphedForward)
    # nothing fused is left on the stock ControlNet (the second plan was made while the first was applied)
    left = [n for n, m in cm.named_modules() if type(m).__name__.startswith("SDAccel")]
    assert not left, left
    assert all(torch.equal(a, b) for a, b in zip(again, ref))


def _takes_rows():
    """Current ComfyUI passes transformer_options (with cond_or_uncond) to get_control; 2024's does not."""
    import comfy.controlnet
    return "transformer_options" in inspect.signature(comfy.controlnet.ControlNet.get_control).parameters


def _control_rows(cn, x, t, ctx, cond_or_uncond):
    """get_control as ComfyUI's calc_cond_batch calls it for chunks labelled `cond_or_uncond` (0 cond, 1 uncond);
    None when the ControlNet gave no control at all."""
    import comfy.model_management as mm
    mm.load_models_gpu(cn.get_models())
    link = cn
    while link is not None:
        link.model_sampling_current = _Sampling()
        link = link.previous_controlnet
    to = {"cond_or_uncond": list(cond_or_uncond), "uuids": ["u%d" % i for i in range(len(cond_or_uncond))]}
    cond = {"c_crossattn": ctx}
    args = (to,) if _takes_rows() else ()
    if _takes_rows():
        cond["transformer_options"] = to
    with torch.inference_mode():
        out = cn.get_control(x, t, cond, len(cond_or_uncond), *args)
    if out is None:
        return None
    return [v for k in ("input", "middle", "output") for v in out[k] if v is not None]


def _chain(load, seeds=(1,)):
    head = None
    for i, s in enumerate(seeds):
        head = load().copy().set_cond_hint(_hint(s), 1.0 - 0.25 * i).set_previous_controlnet(head)
    return head


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["cond_first", "uncond_first"])
def test_cond_only_runs_the_cond_rows_and_leaves_the_uncond_rows_without_control(comfy_cn, order):
    """Lossy opt-in mode: on a cond+uncond batch the ControlNet chain (two links) runs on the cond rows
    only; those rows get exactly stock's residuals, the uncond rows none (zeros). With it off nothing
    changes. Without cond/uncond labels (2024's ComfyUI) the full batch runs, lossless, and the report says so."""
    load, host_cn = comfy_cn
    stock = _chain(load, seeds=(1, 2))
    x, t, ctx = _inputs()
    x = torch.cat([x, x[:1] * 0.5])            # 3 rows per chunk: a batch of 3 latents
    x = torch.cat([x, x.flip(0)])               # two chunks of 3 rows
    t = torch.full((6,), 700.0)
    ctx = torch.cat([ctx[:1]] * 3 + [ctx[1:]] * 3)
    ref = _control_rows(stock, x, t, ctx, order)

    off, info_off = host_cn.accelerate_controlnet(stock, host_cn.ControlNetOptions(fused_kernels=False))
    assert "get_control" not in off.__dict__ and "cond_only" not in info_off
    assert all(torch.equal(a, b) for a, b in zip(_control_rows(off, x, t, ctx, order), ref))
    assert "cond only" not in host_cn.summary(info_off)

    opts = host_cn.ControlNetOptions(fused_kernels=False, cond_only=True)
    fast, info = host_cn.accelerate_controlnet(stock, opts)
    assert "get_control" in fast.__dict__ and "get_control" not in stock.__dict__, "only our copy"
    out = _control_rows(fast, x, t, ctx, order)
    assert len(out) == len(ref)
    cs = info["cond_only"]
    if not _takes_rows():
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), "no labels: the full batch, lossless"
        assert cs == {"halved": 0, "uncond_skipped": 0, "no_info": 1}
        assert "ran the full batch, lossless" in host_cn.summary(info)
        return
    cond = slice(0, 3) if order[0] == 0 else slice(3, 6)
    unc = slice(3, 6) if order[0] == 0 else slice(0, 3)
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        # the cond rows ran as a batch of 3 instead of 6: equal up to the conv's batch-size rounding
        assert torch.allclose(a[cond], b[cond], rtol=1e-4, atol=1e-4), float((a[cond] - b[cond]).abs().max())
        assert not a[unc].any(), "no residual on the uncond rows"
        assert b[unc].abs().sum() > 0
    assert cs == {"halved": 1, "uncond_skipped": 0, "no_info": 0}

    # a batch of cond rows only runs as stock; a batch of uncond rows only gets no control
    alone = _control_rows(fast, x[cond], t[cond], ctx[cond], [0])
    assert all(torch.allclose(a, b[cond], rtol=1e-4, atol=1e-4) for a, b in zip(alone, ref))
    assert _control_rows(fast, x[unc], t[unc], ctx[unc], [1]) is None
    assert info["cond_only"] == {"halved": 1, "uncond_skipped": 1, "no_info": 0}
    line = host_cn.summary(info)
    assert "cond only (lossy): uncond rows skipped in 2 calls" in line and "lossless" not in line, line

    # no labels at all (another caller): the full batch, lossless
    link = fast
    while link is not None:
        link.model_sampling_current = _Sampling()
        link = link.previous_controlnet
    with torch.inference_mode():
        full = fast.get_control(x, t, {"c_crossattn": ctx}, 2, {})
    full = [v for k in ("input", "middle", "output") for v in full[k] if v is not None]
    assert all(torch.equal(a, b) for a, b in zip(full, ref))
    assert info["cond_only"]["no_info"] == 1 and "ran the full batch, lossless" in host_cn.summary(info)

    link = fast
    while link is not None:                   # the class's own method again on every link: stock behaviour
        del link.get_control
        link = link.previous_controlnet
    assert all(torch.equal(a, b) for a, b in zip(_control_rows(fast, x, t, ctx, order), ref))


def test_cond_only_with_the_graphed_forward(comfy_cn):
    """cond_only over the CUDA-graph stand-in (eager on CPU): the half batch goes through the stand-in."""
    from sd_accel.engine.graphs.graphed_forward import GraphedForward
    load, host_cn = comfy_cn
    stock = _chain(load)
    x, t, ctx = _inputs()
    ref = _control_rows(stock, x, t, ctx, (1, 0))
    opts = host_cn.ControlNetOptions(fused_kernels=False, cuda_graph=True, channels_last=True, cond_only=True)
    fast, info = host_cn.accelerate_controlnet(stock, opts)
    out = _control_rows(fast, x, t, ctx, (1, 0))
    assert isinstance(fast.control_model.__dict__.get("forward"), GraphedForward)
    assert host_cn.graph_stats(info)["eager"] >= 1
    if _takes_rows():
        assert all(not a[:1].any() and torch.allclose(a[1:], b[1:], rtol=1e-4, atol=1e-4) for a, b in zip(out, ref))
    else:
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_the_next_prompt_reuses_the_controlnets_plan_and_still_matches_stock(comfy_cn):
    """Each prompt makes a new patcher clone of the ControlNet; its folded stand-ins are planned once per cldm
    module and options and handed to every later clone (ComfyUI swaps them in as they are), which stays
    equal to stock through a stock run in between and a new hint."""
    load, host_cn = comfy_cn
    base = load()
    x, t, ctx = _inputs()
    outs = []
    for seed in (1, 2):
        stock = base.copy().set_cond_hint(_hint(seed), 0.8)
        ref = _control(stock, x, t, ctx)
        stock.cleanup()
        fast, info = host_cn.accelerate_controlnet(stock)
        out = _control(fast, x, t, ctx)
        assert _rel(out, ref) < 1e-4, (seed, _rel(out, ref))
        assert _applied(fast), "the fused modules are in while its patcher is loaded"
        outs.append(fast.control_model_wrapped.object_patches)
        fast.cleanup()
    folded = [k for k, m in outs[0].items() if host_cn.object_patches.is_folded(m)]
    assert folded and all(outs[1][k] is outs[0][k] for k in folded), "the second prompt reused the plan"


def test_another_packs_patch_on_the_controlnet_stays_in_effect_and_keys_the_plan(comfy_cn):
    """A ControlNet whose patcher already carries another pack's object patch under a block: that block is
    patched module by module (the other module runs, the result is stock's with it); a different module
    there gets a plan of its own rather than the one kept for the first."""
    load, host_cn = comfy_cn
    base = load()
    x, t, ctx = _inputs()
    path, attn = next((n, m) for n, m in base.control_model.named_modules()
                      if n.startswith("input_blocks") and n.endswith("attn1"))
    plans = []
    for _ in range(2):
        stock = base.copy().set_cond_hint(_hint(1), 0.8)
        stock.control_model_wrapped = stock.control_model_wrapped.clone()
        tag = comfy_inproc.TaggedModule(attn)
        stock.control_model_wrapped.add_object_patch(path, tag)
        ref = _control(stock, x, t, ctx)
        stock.cleanup()
        calls = tag.calls
        fast, _ = host_cn.accelerate_controlnet(stock)
        keys = fast.control_model_wrapped.object_patches
        assert "input_blocks" not in keys and keys[path] is tag
        out = _control(fast, x, t, ctx)
        assert tag.calls > calls, "the other pack's module ran in the accelerated ControlNet"
        assert _rel(out, ref) < 1e-4
        plans.append({k: m for k, m in keys.items() if host_cn.object_patches.is_folded(m)})
        fast.cleanup()
    assert plans[0] and all(plans[1][k] is not m for k, m in plans[0].items()), "a new module, a new plan"


def test_after_a_run_the_controlnets_conv_weights_are_in_stocks_layout_for_the_next_stock_node(comfy_cn):
    """The conv weights are the user's ControlNet's. Current ComfyUI calls ON_DETACH when a stock node loads them,
    and the stand-in puts them back then; ComfyUI 2024 has no such callback, so release() does it after each
    accelerated run. (On a CPU no run converts them: the test converts them as a GPU run's first call would.)"""
    load, host_cn = comfy_cn
    stock = load().copy().set_cond_hint(_hint(2), 0.7)
    opts = host_cn.ControlNetOptions(fused_kernels=True, cuda_graph=True, channels_last=True)
    fast, info = host_cn.accelerate_controlnet(stock, opts)
    _control(fast, *_inputs())
    gf = stock.control_model.forward
    gf._to_channels_last()
    convs = [m.weight for m in stock.control_model.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.dim() == 4
             and m.weight.shape[1] > 1 and m.weight.shape[-1] > 1]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
    host_cn.release(info)
    import comfy.model_patcher
    detaches = hasattr(comfy.model_patcher.ModelPatcher, "add_callback_with_key")
    if detaches:     # current ComfyUI: left to ON_DETACH (no conversion per run)
        assert all(not w.is_contiguous() for w in convs) and not gf.relayout_pending
    else:            # ComfyUI 2024: back in stock's layout now, converted again by the next accelerated call
        assert all(w.is_contiguous() for w in convs) and gf.relayout_pending


def test_an_older_runs_copy_freed_during_a_later_run_leaves_the_layout_to_the_newest(comfy_cn):
    """Each accelerated run makes its own copy of the ControlNet (its own patcher), all holding the one stand-in of
    the cldm module. A copy's patcher freed later, during another run, detaches too (current ComfyUI's
    ModelPatcher.__del__): had it put the weights back in stock's layout then, the running copy's graphs (captured
    over channels_last) would replay over the other layout. Only the newest copy's detach puts them back."""
    import gc
    load, host_cn = comfy_cn
    stock = load().copy().set_cond_hint(_hint(4), 0.8)
    opts = host_cn.ControlNetOptions(fused_kernels=True, cuda_graph=True, channels_last=True)
    older = host_cn.accelerate_controlnet(stock, opts)[0]
    _control(older, *_inputs())
    newer = host_cn.accelerate_controlnet(stock, opts)[0]
    _control(newer, *_inputs())       # loading the newer copy unloads the older one (ComfyUI's clone rule)
    gf = stock.control_model.forward
    assert gf is older.control_model_wrapped.object_patches["forward"] is newer.control_model_wrapped.object_patches[
        "forward"], "one stand-in per module and options"
    gf._to_channels_last()            # what the newer run's first GPU call does
    convs = [m.weight for m in stock.control_model.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.dim() == 4
             and m.weight.shape[1] > 1 and m.weight.shape[-1] > 1]
    assert convs and all(not w.is_contiguous() for w in convs)
    del older
    gc.collect()                      # the older copy's patcher is freed (and detached) during the newer run
    assert all(not w.is_contiguous() for w in convs) and gf.channels_last_done, "the running copy's layout changed"
    _control(stock, *_inputs())       # a stock node loads the user's ControlNet
    import comfy.model_patcher
    if hasattr(comfy.model_patcher.ModelPatcher, "add_callback_with_key"):   # current ComfyUI: ON_DETACH of the newer
        assert all(w.is_contiguous() for w in convs) and gf.relayout_pending
    else:   # ComfyUI 2024 has no callbacks: release() puts the layout back after each accelerated run
        assert all(not w.is_contiguous() for w in convs)


def test_a_union_controlnet_with_the_fused_modules_and_the_hint_cache_matches_stock_for_each_type(comfy_cn):
    """ControlNet Union (ControlNet++): the control type (SetUnionControlNetType) reaches the model's forward, which
    runs the hint block inside its merge of the hint's features with the type's task embedding (a transformer layer
    of LayerNorms and attention). The fused modules give stock's residuals for each type, over steps. The union's
    forward hands the hint block a new view of the hint at each call (`hint.unsqueeze(0)[idx]`); the hint cache
    keys a view by the tensor it views, so the block runs once per type."""
    union = comfy_inproc.fixtures_module().union_controlnet(COMFY, "tiny", seed=5)
    if union is None:
        pytest.skip("this ComfyUI (2024) has no ControlNet Union")
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    load, host_cn = comfy_cn
    x, t, ctx = _inputs()
    first = {}
    for type_name in ("depth", "canny/lineart/anime_lineart/mlsd"):
        stock = SetUnionControlNetType().set_controlnet_type(union, type_name)[0].set_cond_hint(_hint(1), 0.8)
        assert stock.extra_args["control_type"], stock.extra_args
        refs = [_control(stock, x, t + 100.0 * i, ctx) for i in range(2)]
        stock.cleanup()
        fast, info = host_cn.accelerate_controlnet(stock)
        assert info["patched"].get("layer_norm") and info["patched"].get("hint_cache") == 1, info["patched"]
        k0 = kernel_report.snapshot()
        outs = [_control(fast, x, t + 100.0 * i, ctx) for i in range(2)]
        ran = kernel_report.summarize(k0, kernel_report.snapshot())
        assert ran["group_norm_silu"]["fused"] > 0 and all(e["fallback"] == 0 for e in ran.values()), ran
        assert host_cn.hint_stats(info) == {"hits": 1, "misses": 1}, host_cn.hint_stats(info)
        for out, ref in zip(outs, refs):
            assert len(out) == len(ref) and _rel(out, ref) < 1e-4, (type_name, _rel(out, ref))
        first[type_name] = outs[0]
        fast.cleanup()
        host_cn.release(info)
    a, b = first.values()
    assert _rel(a, b) > 1e-3, "the control type must change the residuals, or this test could not see a mix-up"


def test_a_union_controlnets_type_embedding_gets_its_type_as_a_slice_with_graphs_on(comfy_cn, monkeypatch):
    """The union model's type embedding indexes a GPU tensor with a Python list of types, a copy from host memory
    that no CUDA graph can hold: with graphs on, a stand-in hands the host's own forward the one type as a slice
    (a fill on the device). The residuals are stock's to the bit, over steps and types."""
    union = comfy_inproc.fixtures_module().union_controlnet(COMFY, "tiny", seed=5)
    if union is None:
        pytest.skip("this ComfyUI (2024) has no ControlNet Union")
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    load, host_cn = comfy_cn
    x, t, ctx = _inputs()
    embedding_class = type(union.control_model.control_add_embedding)
    host_forward, seen = embedding_class.forward, []

    def recording(self, control_type, *args):
        seen.append(control_type)
        return host_forward(self, control_type, *args)
    monkeypatch.setattr(embedding_class, "forward", recording)
    opts = host_cn.ControlNetOptions(cuda_graph=True, fused_kernels=False)
    for type_name in ("depth", "canny/lineart/anime_lineart/mlsd"):
        stock = SetUnionControlNetType().set_controlnet_type(union, type_name)[0].set_cond_hint(_hint(1), 0.8)
        k = stock.extra_args["control_type"][0]
        refs = [_control(stock, x, t + 100.0 * i, ctx) for i in range(2)]
        assert seen[-1] == [k], seen
        stock.cleanup()
        fast, info = host_cn.accelerate_controlnet(stock, opts)
        assert info["patched"].get("control_type_slice") == 1, info["patched"]
        outs = [_control(fast, x, t + 100.0 * i, ctx) for i in range(2)]
        assert seen[-2:] == [slice(k, k + 1)] * 2, seen
        for out, ref in zip(outs, refs):
            assert len(out) == len(ref) and _rel(out, ref) == 0.0, (type_name, _rel(out, ref))
        fast.cleanup()
        host_cn.release(info)
