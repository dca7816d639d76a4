"""hosts/a1111.py on the real ldm UNetModel (the class A1111 v1.10.1 runs for SD1.x)."""
import torch

from sd_accel.engine.patches import fused_modules
from sd_accel.engine.reports import kernel_report
from sd_accel.hosts import a1111, a1111_graph_route, webui

from unet_util import make_unet, unet_inputs

ON = a1111.A1111Options()


def run(unet, inputs):
    with torch.no_grad():
        return unet(*inputs)


def module_map(unet):
    return {name: m for name, m in unet.named_modules()}


def test_fused_kernels_run_and_match():
    """The Triton kernels really run (CPU interpreter) and give the stock output."""
    unet, inputs = make_unet(), unet_inputs()
    ref = run(unet, inputs)
    s = a1111.apply(unet, ON)
    assert s["counts"] == {"group_norm_silu": 11, "silu_folded": 11, "group_norm": 4, "layer_norm": 12, "geglu": 4}
    assert s["patched"] == sum(s["counts"].values()) == 42   # every replaced module counted once
    before = kernel_report.snapshot()
    out = run(unet, inputs)
    used = kernel_report.summarize(before, kernel_report.snapshot())
    assert set(used) == {"group_norm_silu", "group_norm", "layer_norm", "geglu"}
    for op, e in used.items():
        assert e["fused"] > 0 and e["fallback"] == 0, (op, e)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_remove_restores_originals(stock_kernels):
    unet, inputs = make_unet(), unet_inputs()
    orig = module_map(unet)
    ref = run(unet, inputs)
    a1111.apply(unet, ON)
    assert sum(fused_modules.is_fused(m) for m in unet.modules()) == 42
    assert a1111.remove(unet) == 42   # 31 fused + 11 folded SiLUs
    now = module_map(unet)
    assert now.keys() == orig.keys()
    assert all(now[k] is orig[k] for k in orig)
    assert not any(fused_modules.is_fused(m) for m in unet.modules())
    torch.testing.assert_close(run(unet, inputs), ref, atol=0, rtol=0)
    assert a1111.remove(unet) == 0    # nothing left to do


def test_state_dict_keys_and_strict_false_reload(stock_kernels):
    """A1111 reloads a same-config checkpoint into the patched model with strict=False: no key may
    be skipped, and the new weights must reach the fused modules."""
    unet, inputs = make_unet(0), unet_inputs()
    keys = list(unet.state_dict().keys())
    a1111.apply(unet, ON)
    assert list(unet.state_dict().keys()) == keys
    other = make_unet(seed=7)
    result = unet.load_state_dict(other.state_dict(), strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert a1111.check_keys(unet)
    torch.testing.assert_close(run(unet, inputs), run(other, inputs), atol=2e-5, rtol=1e-4)
    a1111.remove(unet)   # the originals share the Parameters: they hold the reloaded weights too
    torch.testing.assert_close(run(unet, inputs), run(other, inputs), atol=0, rtol=0)


def test_apply_twice_is_a_no_op(stock_kernels):
    unet = make_unet()
    s1 = a1111.apply(unet, ON)
    mods = module_map(unet)
    s2 = a1111.apply(unet, ON)
    assert s2 == s1
    assert all(module_map(unet)[k] is m for k, m in mods.items())


def test_options_off_remove(stock_kernels):
    unet = make_unet()
    orig = module_map(unet)
    a1111.apply(unet, ON)
    for opts in (a1111.A1111Options(fused_kernels=False), a1111.A1111Options(enabled=False)):
        a1111.apply(unet, ON)
        s = a1111.sync(type("M", (), {"model": type("W", (), {"diffusion_model": unet})()})(), opts)
        assert s["patched"] == 0
        assert all(module_map(unet)[k] is m for k, m in orig.items())


def test_channels_last_and_graphs_are_cuda_only(stock_kernels):
    unet, inputs = make_unet(), unet_inputs()
    s = a1111.apply(unet, ON)
    assert s["channels_last"] is False   # CPU UNet: weights left as they are
    assert all(m.weight.is_contiguous() for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    with torch.no_grad():   # as A1111 samples
        out = a1111_graph_route.graph_forward(unet, UNetModel.forward, *inputs)
    torch.testing.assert_close(out, run(unet, inputs), atol=0, rtol=0)
    st = a1111.status(unet)["graphs"]
    assert st["replays"] == 0 and st["eager"] == 1 and st["last_eager_reason"] == "no CUDA device"
    # under autograd (A1111's training tab) the stock modules run, whatever the device
    with torch.enable_grad():
        out = a1111_graph_route.graph_forward(unet, UNetModel.forward, *inputs)
    torch.testing.assert_close(out, run(unet, inputs), atol=0, rtol=0)
    st = a1111.status(unet)["graphs"]
    assert st["eager"] == 2 and st["last_eager_reason"].startswith("autograd is on"), st


def test_keys_changed_behind_our_back_restores(stock_kernels):
    """If something renames a parameter under a patched module, the next sync puts originals back
    before re-applying, so the next reload is not silently partial."""
    unet = make_unet()
    a1111.apply(unet, ON)
    path = a1111.status(unet)["paths"][0]
    mod = unet.get_submodule(path)
    mod._parameters["renamed"] = mod._parameters.pop("weight")   # the replacement's own dict only
    assert not a1111.check_keys(unet)
    holder = type("M", (), {"model": type("W", (), {"diffusion_model": unet})()})()
    s = a1111.sync(holder, ON)
    assert s["state_dict_keys_unchanged"] and s["patched"] == 42
    assert a1111.check_keys(unet)
    assert unet.get_submodule(path) is not mod


def test_remove_carries_replaced_parameters_and_lora_state(stock_kernels):
    """A Parameter the host swapped for a new object while patched (not an in-place update), and
    A1111 Lora's per-module bookkeeping, reach the original module when it is put back."""
    unet = make_unet()
    a1111.apply(unet, ON)
    path = a1111.status(unet)["paths"][0]
    mine = unet.get_submodule(path)
    new_w = torch.nn.Parameter(torch.full_like(mine.weight, 0.5))
    mine._parameters["weight"] = new_w
    mine.network_current_names = (("lora", 1.0, 1.0, None),)
    a1111.remove(unet)
    orig = unet.get_submodule(path)
    assert orig is not mine and orig.weight is new_w
    assert orig.network_current_names == (("lora", 1.0, 1.0, None),)


def test_graph_path_timestep_embedding_is_bitwise_ldms_and_restored(stock_kernels):
    """ldm copies its sinusoid frequencies host-to-device on every call, which a CUDA-graph capture
    refuses (seen on the H200: the capture failed, every step ran eagerly). The graph path uses a copy
    kept on the device: same values bit for bit, and ldm's own function is back after the call."""
    import ldm.modules.diffusionmodules.openaimodel as om
    original = om.timestep_embedding
    ours = webui.graphable_timestep_embedding(original)
    t = torch.tensor([999.0, 500.5, 1.0, 0.0])
    for dim in (320, 321):
        assert torch.equal(ours(t, dim), original(t, dim))
    assert torch.equal(ours(t, 8, repeat_only=True), original(t, 8, repeat_only=True))
    unet, inputs = make_unet(), unet_inputs()
    seen = []
    unet.time_embed.register_forward_pre_hook(lambda m, a: seen.append(om.timestep_embedding))
    out = a1111_graph_route.graph_forward(unet, om.UNetModel.forward, *inputs)
    assert getattr(seen[0], "sd_accel_original", None) is original, "the graph path uses the device-kept copy"
    assert om.timestep_embedding is original
    torch.testing.assert_close(out, run(unet, inputs), atol=0, rtol=0)


def _fused_calls(unet, inputs):
    before = kernel_report.snapshot()
    out = run(unet, inputs)
    return out, sum(e["fused"] + e["fallback"] for e in kernel_report.summarize(before, kernel_report.snapshot()).values())


def test_calls_outside_the_graph_route_take_the_measured_eager_path(stock_kernels, monkeypatch):
    """A call A1111 makes to the UNet itself (CUDA graphs off, another "SD Unet", sd-webui-controlnet's own
    forward) runs on the eager path the engine chooses per shape: on the stock modules it is stock's, bit for bit,
    and no fused module runs. Forced both ways here (a CPU has no timing to choose by)."""
    from sd_accel.engine.graphs import eager
    unet, inputs = make_unet(), unet_inputs()
    ref = run(unet, inputs)
    a1111.apply(unet, ON)
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")
    out, calls = _fused_calls(unet, inputs)
    assert calls == 0 and torch.equal(out, ref)
    assert a1111.status(unet)["outside_graphs"]["stock_calls"] == 1
    monkeypatch.setattr(eager, "FORCED_PATH", "fused")
    out, calls = _fused_calls(unet, inputs)
    assert calls > 0
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_the_graph_routes_calls_are_left_to_it_unless_the_unets_forward_was_replaced(stock_kernels, monkeypatch):
    """While SD Accel's "SD Unet" is active its graph route runs the UNet's calls (its refused keys measure their
    own path), so the hooks leave them alone; an extension that sets the UNet's own `forward` (sd-webui-controlnet
    does) bypasses the route, and its calls take the eager path again. `remove` takes the hooks off."""
    import types
    from sd_accel.engine.graphs import eager
    unet, inputs = make_unet(), unet_inputs()
    a1111.apply(unet, ON)
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")
    a1111._state(unet).route_active = True
    assert _fused_calls(unet, inputs)[1] > 0      # left to the route: the fused modules, as the route's warm-up runs
    unet.forward = types.MethodType(type(unet).forward, unet)   # an extension's own forward on the instance
    assert _fused_calls(unet, inputs)[1] == 0
    hooks = len(unet._forward_pre_hooks) + len(unet._forward_hooks)
    a1111.remove(unet)
    assert len(unet._forward_pre_hooks) + len(unet._forward_hooks) == hooks - 2


def test_channels_last_only_with_the_graphs(stock_kernels, monkeypatch):
    """channels_last serves the CUDA graphs: with them off a (CUDA) UNet keeps stock's layout, where its calls,
    fused or stock, run faster; turning the graphs on converts, off again converts back. (The layout is CUDA's
    business: `_on_cuda` stands in for a GPU here.)"""
    monkeypatch.setattr(a1111, "_on_cuda", lambda unet: True)
    unet = make_unet()
    spatial = [m.weight for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] > 1]
    for graphs, cl in ((False, False), (True, True), (False, False)):
        s = a1111.apply(unet, a1111.A1111Options(cuda_graph=graphs))
        assert s["channels_last"] is cl and all(w.is_contiguous() is not cl for w in spatial), graphs


def test_a_unet_loaded_channels_last_stays_so(stock_kernels, monkeypatch):
    """A1111's --opt-channelslast loads the UNet channels_last (`sd_model.to(memory_format=torch.channels_last)`):
    that is stock's layout, and SD Accel leaves it so with graphs off, on and off again, and when removed."""
    monkeypatch.setattr(a1111, "_on_cuda", lambda unet: True)
    unet = make_unet().to(memory_format=torch.channels_last)
    spatial = [m.weight for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] > 1]
    for graphs in (False, True, False):
        s = a1111.apply(unet, a1111.A1111Options(cuda_graph=graphs))
        assert s["channels_last"] is True and not any(w.is_contiguous() for w in spatial), graphs
    a1111.remove(unet)
    assert not any(w.is_contiguous() for w in spatial)
