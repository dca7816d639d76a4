"""fp8-stored weights at precision fp16: the upcast stand-ins compute exactly what ComfyUI's manual cast computes
(bit for bit, on ComfyUI's real UNet with fp8 weights, CPU), and a replaced weight is upcast anew."""
import pytest
import torch

import comfy_inproc
from refcount import no_garbage_collection


@pytest.fixture(scope="module")
def fp8_unet():
    comfy_inproc.fixtures_module()     # ComfyUI importable
    import comfy.ops
    unet = comfy_inproc.tiny_unet(operations=comfy.ops.manual_cast)
    with torch.no_grad():
        for m in unet.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
                m.weight.data = m.weight.data.to(torch.float8_e4m3fn)
                if m.bias is not None:
                    m.bias.data = m.bias.data.half()
            elif getattr(m, "weight", None) is not None and isinstance(m.weight, torch.nn.Parameter):
                m.weight.data, m.bias.data = m.weight.data.half(), m.bias.data.half()
    return unet


def _inputs(unet):
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    return x.half(), t, ctx.half()


def test_upcast_standins_equal_manual_cast(fp8_unet):
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching
    x, t, ctx = _inputs(fp8_unet)
    plan, nbytes = plan_upcast(fp8_unet)
    n = sum(1 for m in fp8_unet.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    assert len(plan) == n and nbytes == 2 * sum(m.weight.numel() for m in fp8_unet.modules()
                                                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    with torch.no_grad():
        ref = fp8_unet(x, t, context=ctx)
        backup = patching.apply_patches(fp8_unet, plan)
        try:
            out = fp8_unet(x, t, context=ctx)
            # a patched weight (a LoRA replaces the Parameter) is upcast anew, as the host would cast it
            lin = fp8_unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
            new_w = torch.nn.Parameter((lin.weight.float() * 1.5).to(torch.float8_e4m3fn), requires_grad=False)
            lin.weight = new_w
            out_patched = fp8_unet(x, t, context=ctx)
        finally:
            patching.restore(fp8_unet, backup)
        orig = fp8_unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
        old_w = orig.weight
        orig.weight = new_w
        ref_patched = fp8_unet(x, t, context=ctx)
        orig.weight = old_w
    assert torch.equal(out, ref)
    assert torch.equal(out_patched, ref_patched) and not torch.equal(out_patched, ref)


def test_the_patch_computes_with_what_the_host_puts_on_its_module_and_leaves_its_marks_alone(fp8_unet):
    """Planned while another clone's LoRA is patched into the layer (and the layer marked loaded and patched by
    ComfyUI), the forward patch is set on the layer itself: it computes with whatever the host restores there, and
    the marks ComfyUI's next load reads (`comfy_patched_weights`) stay on the one object ComfyUI manages."""
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching
    lin = fp8_unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
    original = lin.weight
    x = torch.randn(2, 5, lin.in_features, dtype=torch.float16)
    lin.weight = torch.nn.Parameter((original.float() * 1.5).to(torch.float8_e4m3fn), requires_grad=False)
    lin.comfy_patched_weights = True
    plan = plan_upcast(fp8_unet)[0]
    backup = patching.apply_patches(fp8_unet, plan)
    try:
        assert patching.get_attr(fp8_unet, "input_blocks.1.1.transformer_blocks.0.attn1.to_q") is lin
        lin.weight = original                   # the host takes the other clone's LoRA out
        del lin.comfy_patched_weights           # and unmarks the module, as its unpatch does
        with torch.no_grad():
            ref = torch.nn.functional.linear(x, original.to(torch.float16), lin.bias)
            assert torch.equal(lin(x), ref)
    finally:
        patching.restore(fp8_unet, backup)
        lin.weight = original
        lin.__dict__.pop("comfy_patched_weights", None)


def test_fp8_stored_norms_read_kept_copies_not_the_hosts_cast():
    """ComfyUI's UNETLoader fp8 stores the norms' weights in fp8 too, and its manual cast casts them at every call
    (a cast kernel and a sync with its offload stream each). The fused norms read kept fp16 copies instead: the
    same values, made once; a weight function (low-VRAM LoRA) still goes through the host's cast."""
    comfy_inproc.fixtures_module()
    import comfy.ops
    from sd_accel.engine.patches import fused_modules as fm
    torch.manual_seed(0)
    norms = [comfy.ops.manual_cast.GroupNorm(4, 32), comfy.ops.manual_cast.LayerNorm(32)]
    x4, x3 = torch.randn(2, 32, 4, 4).half(), torch.randn(2, 5, 32).half()
    calls = []

    def counting_cast(m, x):
        calls.append(m)
        return comfy.ops.cast_bias_weight(m, x)

    fm.set_host_weight_caster(counting_cast)
    try:
        for norm, x in zip(norms, (x4, x3)):
            with torch.no_grad():
                # comfy.ops' layers skip initialisation: their weight is whatever memory held (NaN at times)
                norm.weight.data = (1 + torch.rand(32)).to(torch.float8_e4m3fn)
                norm.bias.data = torch.randn(32).to(torch.float8_e4m3fn)
                host_w, host_b = comfy.ops.cast_bias_weight(norm, x)
                w, b = fm.weights_of(norm, x)
                again = fm.weights_of(norm, x)
            assert calls == [] and torch.equal(w, host_w) and torch.equal(b, host_b)
            assert again[0] is w and again[1] is b          # kept, not cast again
            double = lambda t: t * 2                        # noqa: E731
            # current ComfyUI keeps a list of weight functions, ComfyUI 2024 one callable
            norm.weight_function = [double] if isinstance(type(norm).weight_function, list) else double
            with torch.no_grad():
                patched_w, _ = fm.weights_of(norm, x)
            del norm.weight_function
            assert calls == [norm] and torch.equal(patched_w, host_w * 2)
            calls.clear()
    finally:
        fm.set_host_weight_caster(None)


def test_conv_layout_changes_reach_the_kept_copies(fp8_unet):
    """The copies are made in the first (eager) step, with the conv weights in stock's layout; the graphs run with
    them channels_last. A layout change of the weights changes their kept copies' layout too, in their own storage
    (a graph captured over a copy keeps reading it), values unchanged, and back again after the run."""
    from sd_accel.engine.fp8 import weights
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching
    x, t, ctx = _inputs(fp8_unet)
    convs = [m for m in fp8_unet.modules() if isinstance(m, torch.nn.Conv2d)]
    backup = patching.apply_patches(fp8_unet, plan_upcast(fp8_unet)[0])
    try:
        with torch.no_grad():
            fp8_unet(x, t, context=ctx)
            copies = [weights.upcast_copies_of(c.weight) for c in convs]
            assert all(len(cs) == 1 and cs[0].is_contiguous() for cs in copies)
            before = [(cs[0].data_ptr(), cs[0].clone()) for cs in copies]
            patching.convert_conv_weights(fp8_unet, torch.channels_last)
            for cs, (ptr, values) in zip(copies, before):
                assert cs[0].is_contiguous(memory_format=torch.channels_last)
                assert cs[0].data_ptr() == ptr and torch.equal(cs[0], values)
            assert all(weights.upcast_copies_of(c.weight)[0] is cs[0] for c, cs in zip(convs, copies))  # kept
            assert any(not cs[0].is_contiguous() for cs in copies)     # the 3x3 convs did change layout
            out = fp8_unet(x, t, context=ctx)
    finally:
        patching.restore(fp8_unet, backup)
    with torch.no_grad():
        ref = fp8_unet(x, t, context=ctx)       # the host's own cast of the channels_last weights
        patching.convert_conv_weights(fp8_unet, torch.contiguous_format)
    assert torch.equal(out, ref)
    assert all(cs[0].is_contiguous() and cs[0].data_ptr() == ptr for cs, (ptr, _) in zip(copies, before))


def test_the_stock_path_still_reads_the_kept_copies(fp8_unet, monkeypatch):
    """Where graphs do not run, an eager step may take the stock modules (engine/graphs/eager.py); the fp8-stored
    layers then still compute from their kept copies, the host's values without the host's cast at every call
    (which made that step slower than stock's own)."""
    import comfy.ops
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching, stock_path
    x, t, ctx = _inputs(fp8_unet)
    with torch.no_grad():
        ref = fp8_unet(x, t, context=ctx)
    casts = []
    host_cast = comfy.ops.cast_bias_weight

    def counting(m, *args, **kwargs):
        casts.append(type(m).__name__)
        return host_cast(m, *args, **kwargs)

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", counting)
    backup = patching.apply_patches(fp8_unet, plan_upcast(fp8_unet)[0])
    try:
        with torch.no_grad(), stock_path.stock_modules():
            out = fp8_unet(x, t, context=ctx)
    finally:
        patching.restore(fp8_unet, backup)
    assert torch.equal(out, ref)
    assert casts and not [c for c in casts if "Linear" in c or "Conv2d" in c]   # only the norms' own casts


def _counting_casts(monkeypatch):
    """The group casts made (each: the number of groups alive just after it), through the real kernel (coarse tiles:
    comfy_inproc.coarse_upcast_tiles)."""
    from sd_accel.engine.fp8 import block_upcast
    comfy_inproc.coarse_upcast_tiles(monkeypatch)
    casts, real = [], block_upcast.kernel.upcast_fp8

    def counting(sources, dst, layout, pointers):
        out = real(sources, dst, layout, pointers)
        assert real.last_call.path == "triton", real.last_call.reason
        counting.last_call = real.last_call
        casts.append(len(block_upcast._LOCAL.live) + 1)
        return out
    monkeypatch.setattr(block_upcast.kernel, "upcast_fp8", counting)
    return casts


def test_grouped_upcast_equals_manual_cast_casting_each_group_once_a_step(fp8_unet, monkeypatch):
    """"as stored": the layers' weights cast a group at a time inside a step, each group once per forward and
    dropped once its layers have run (at most two groups' fp16 weights alive at once); outside a step the host's
    own cast runs. A LoRA that replaces a weight, or one written into it in place, is seen by the next step."""
    from sd_accel.engine.fp8 import block_upcast
    from sd_accel.engine.fp8.upcast import GroupedUpcastForward, plan_upcast
    from sd_accel.engine.patches import patching
    monkeypatch.setattr(block_upcast, "GROUP_BYTES", 64 << 10)    # the tiny UNet in several groups
    casts = _counting_casts(monkeypatch)
    x, t, ctx = _inputs(fp8_unet)
    plan, nbytes = plan_upcast(fp8_unet, grouped=True)
    assert nbytes == 0 and all(isinstance(p, GroupedUpcastForward) for p in plan.values())
    groups = {id(p.group): p.group for p in plan.values()}
    assert len(groups) >= 4, len(groups)
    # the timestep-embedding projections, read all at once by the first fused ResBlock, in groups of their own
    emb = {id(p.group) for k, p in plan.items() if ".emb_layers." in k}
    assert emb and not emb & {id(p.group) for k, p in plan.items() if ".emb_layers." not in k}
    lin = fp8_unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
    with torch.no_grad():
        ref = fp8_unet(x, t, context=ctx)
        backup = patching.apply_patches(fp8_unet, plan)
        try:
            outside = fp8_unet(x, t, context=ctx)
            assert casts == []
            with block_upcast.step():
                out = fp8_unet(x, t, context=ctx)
                assert block_upcast._LOCAL.live == {}, "a group's buffer outlived its layers"
            assert len(casts) == len(groups) and max(casts) <= 2, casts
            new_w = torch.nn.Parameter((lin.weight.float() * 1.5).to(torch.float8_e4m3fn), requires_grad=False)
            old_w, lin.weight = lin.weight, new_w
            with block_upcast.step():
                out_replaced = fp8_unet(x, t, context=ctx)
            lin.weight = old_w
            saved = old_w.detach().clone()
            old_w.data.copy_(new_w.data)
            with block_upcast.step():
                out_in_place = fp8_unet(x, t, context=ctx)
            old_w.data.copy_(saved)
        finally:
            patching.restore(fp8_unet, backup)
        lin.weight = new_w
        ref_patched = fp8_unet(x, t, context=ctx)
        lin.weight = old_w
    assert torch.equal(outside, ref) and torch.equal(out, ref)
    assert torch.equal(out_replaced, ref_patched) and torch.equal(out_in_place, ref_patched)
    assert not torch.equal(ref_patched, ref)


def test_a_grouped_layer_the_host_must_cast_itself_runs_the_hosts_forward(fp8_unet, monkeypatch):
    """A weight function (LoRA on a low-VRAM model) on one layer of a group: that layer runs the host's cast, the
    group's others their views; a layer called twice in a step casts its group again rather than reading a
    buffer its group may have dropped."""
    from sd_accel.engine.fp8 import block_upcast
    from sd_accel.engine.fp8.upcast import plan_upcast
    from sd_accel.engine.patches import patching
    attn = fp8_unet.input_blocks[1][1].transformer_blocks[0].attn1
    plan = {k: p for k, p in plan_upcast(attn, grouped=True)[0].items()}
    group = next(iter(plan.values())).group
    assert [p.group for p in plan.values()] == [group] * 4          # to_q, to_k, to_v, to_out.0
    casts = _counting_casts(monkeypatch)
    x = torch.randn(2, 6, attn.to_q.in_features, dtype=torch.float16)
    double = lambda w: w * 2                                      # noqa: E731
    attn.to_k.weight_function = [double] if isinstance(type(attn.to_k).weight_function, list) else double
    try:
        with torch.no_grad():
            ref_q, ref_k = attn.to_q(x), attn.to_k(x)
            backup = patching.apply_patches(attn, plan)
            try:
                with block_upcast.step():
                    q, k = attn.to_q(x), attn.to_k(x)
                    q_again = attn.to_q(x)
            finally:
                patching.restore(attn, backup)
    finally:
        del attn.to_k.weight_function
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(q_again, ref_q)
    assert len(casts) == 2, casts


@pytest.mark.parametrize("grouped", [False, True], ids=["copies", "grouped"])
def test_a_layer_wearing_its_forward_patch_is_freed_without_a_garbage_collection(grouped):
    """A forward patch is set as the layer's own `forward` (ComfyUI leaves a loaded model's object patches applied
    when the user's graph drops it and its patcher is freed): it and its group must not hold the layer in a cycle,
    or the layer's weights stay in VRAM until a garbage collection runs."""
    import weakref
    from sd_accel.engine.fp8.upcast import plan_upcast
    lin = torch.nn.Linear(16, 16)
    lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    lin.comfy_cast_weights = True
    root = torch.nn.Sequential(lin)
    for path, patch in plan_upcast(root, grouped=grouped)[0].items():
        assert path == "0.forward"
        lin.forward = patch
    ref = weakref.ref(lin)
    with no_garbage_collection():
        del lin, root, patch
        assert ref() is None, "the layer outlived its last reference"
