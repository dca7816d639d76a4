"""Another extension's hook inside A1111's UNet forward (hosts/a1111_unet_hooks.py), with the stand-ins of A1111's
UNet torch proxy (fake_a1111/modules/sd_hijack_unet.py) and of sd-webui-freeu (lib_free_u/): the graph route runs
such calls eagerly, with the hook's image and the reason counted, unless the extension is switched off; a graph
captured at one step would replay its decision at every other (tests/gpu/test_a1111_hooks_gpu.py shows it)."""
import types

import pytest
import torch

from sd_accel.hosts import a1111, a1111_graph_route, a1111_unet_hooks

import regional_prompter_standin
from kohya_hiresfix_standin import Scaler
from unet_util import make_unet, unet_inputs

STAGES = {32: (1.6, 0.1)}   # the test UNet's 32 channels: backbone factor, skip scale


@pytest.fixture
def freeu(fake_a1111, monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    from lib_free_u import global_state, unet as freeu_unet
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)      # as A1111's apply_optimizations sets it
    monkeypatch.setattr(global_state, "instance", types.SimpleNamespace(enable=True, stages=STAGES, start_step=0,
                                                                        stop_step=None))
    monkeypatch.setattr(global_state, "sampling_step", 0)
    remove = freeu_unet.patch()
    yield global_state
    remove()


def _stock(unet, inputs):
    with torch.no_grad():
        return unet(*inputs)


def _graph_route(unet, inputs):
    import ldm.modules.diffusionmodules.openaimodel as om
    with torch.no_grad():
        return a1111_graph_route.graph_forward(unet, om.UNetModel.forward, *inputs)


def _hook_refusals(unet):
    return sum(n for why, n in a1111._state(unet).graphs.refused.items() if "skip concatenation" in why)


def test_freeus_hook_sends_the_graph_route_eager_with_its_image(freeu, stock_kernels):
    unet, inputs = make_unet(), unet_inputs()
    with_freeu = _stock(unet, inputs)
    freeu.instance.enable = False
    without = _stock(unet, inputs)
    assert float((with_freeu - without).norm() / without.norm()) > 1e-2      # the hook acts on this UNet
    freeu.instance.enable = True
    a1111.apply(unet, a1111.A1111Options())
    why = a1111_unet_hooks.reason(unet)
    assert why and "free_u_cat_hijack from lib_free_u.unet" in why, why
    out = _graph_route(unet, inputs)
    torch.testing.assert_close(out, with_freeu, atol=2e-5, rtol=1e-4)
    assert _hook_refusals(unet) == 1


def test_switched_off_freeu_lets_graphs_run_and_on_again_refuses(freeu, stock_kernels):
    unet, inputs = make_unet(), unet_inputs()
    a1111.apply(unet, a1111.A1111Options())
    freeu.instance.enable = False
    assert a1111_unet_hooks.reason(unet) is None
    _graph_route(unet, inputs)
    assert _hook_refusals(unet) == 0
    freeu.instance.enable = True
    _graph_route(unet, inputs)
    assert _hook_refusals(unet) == 1


def test_a1111s_own_proxy_and_plain_torch_are_no_hook(fake_a1111, monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    unet = make_unet()
    monkeypatch.setattr(om, "th", torch)
    assert a1111_unet_hooks.reason(unet) is None
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)
    assert a1111_unet_hooks.reason(unet) is None


def test_another_extensions_hook_or_torch_is_refused_whatever_its_name(fake_a1111, monkeypatch):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    unet = make_unet()
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)
    monkeypatch.setattr(sd_hijack_unet.th, "cat", lambda tensors, *a, **k: torch.cat(tensors, *a, **k), raising=False)
    assert "skip concatenation" in a1111_unet_hooks.reason(unet)
    monkeypatch.delattr(sd_hijack_unet.th, "cat")
    monkeypatch.setattr(om, "th", types.SimpleNamespace(cat=torch.cat))
    assert "replaced the torch" in a1111_unet_hooks.reason(unet)


def test_kohya_hiresfix_blocks_send_the_graph_route_eager_until_taken_out(fake_a1111, monkeypatch, stock_kernels):
    import ldm.modules.diffusionmodules.openaimodel as om
    from modules import sd_hijack_unet
    monkeypatch.setattr(om, "th", sd_hijack_unet.th)      # its cat resizes the skips the wrapper left smaller
    unet, inputs = make_unet(), unet_inputs()
    plain = _stock(unet, inputs)
    a1111.apply(unet, a1111.A1111Options())
    down, up = unet.input_blocks[1], unet.output_blocks[0]
    unet.input_blocks[1], unet.output_blocks[0] = Scaler(0.5, down), Scaler(2.0, up)
    scaled = _stock(unet, inputs)
    assert float((scaled - plain).norm() / plain.norm()) > 1e-2
    why = a1111_unet_hooks.reason(unet)
    assert why and "input_blocks[1] (Scaler from kohya_hiresfix_standin)" in why, why
    torch.testing.assert_close(_graph_route(unet, inputs), scaled, atol=2e-5, rtol=1e-4)
    refused = sum(n for w, n in a1111._state(unet).graphs.refused.items() if "among the UNet's blocks" in w)
    assert refused == 1
    unet.input_blocks[1], unet.output_blocks[0] = down, up
    assert a1111_unet_hooks.reason(unet) is None
    torch.testing.assert_close(_graph_route(unet, inputs), plain, atol=2e-5, rtol=1e-4)


def test_regional_prompters_forwards_send_the_graph_route_eager(fake_a1111, stock_kernels):
    unet, inputs = make_unet(), unet_inputs()
    a1111.apply(unet, a1111.A1111Options())
    a1111.new_sampling_run(types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet)))
    assert a1111_unet_hooks.foreign_forward_in_run(unet, a1111._state(unet)) is None
    calls = []
    regional_prompter_standin.hook_forwards(unet, calls)
    refs = [_stock(unet, inputs) for _ in range(2)]                 # the first call halves the context, the second not
    assert float((refs[0] - refs[1]).norm() / refs[1].norm()) > 1e-3
    a1111.new_sampling_run(types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet)))  # the next run
    st = a1111._state(unet)
    why = a1111_unet_hooks.foreign_forward_in_run(unet, st)
    assert why and "attn2" in why and "regional_prompter_standin" in why, why
    outs = [_graph_route(unet, inputs) for _ in range(2)]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert sum(n for w, n in st.graphs.refused.items() if "set the forward of" in w) == 2
    assert [why] == list(a1111.status(unet)["graphs"]["refused"])     # what /sd_accel/status shows the user


def test_a1111s_hypertile_refuses_graphs_while_on_and_lets_them_run_switched_off(fake_a1111, stock_kernels,
                                                                                 monkeypatch):
    import os
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "hypertile_standin_pkg"))
    import hypertile
    unet, inputs = make_unet(), unet_inputs()
    plain = _stock(unet, inputs)
    params = [hypertile.hook(m) for n, m in unet.named_modules() if n.endswith("attn1")]
    tiled = _stock(unet, inputs)
    assert params and float((tiled - plain).norm() / plain.norm()) > 1e-3
    a1111.apply(unet, a1111.A1111Options())
    st = a1111._state(unet)
    run = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=unet))
    a1111.new_sampling_run(run)
    why = a1111_unet_hooks.foreign_forward_in_run(unet, st)
    assert why and "attn1" in why and "hypertile" in why, why
    torch.testing.assert_close(_graph_route(unet, inputs), tiled, atol=2e-5, rtol=1e-4)
    for p in params:
        p.enabled = False
    a1111.new_sampling_run(run)
    assert a1111_unet_hooks.foreign_forward_in_run(unet, st) is None
    torch.testing.assert_close(_graph_route(unet, inputs), plain, atol=2e-5, rtol=1e-4)
