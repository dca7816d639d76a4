"""Between SD Accel's sampling runs the loaded model's conv weights are in stock's layout: graphs are captured
over channels_last conv weights (on a GPU, before the first capture), and stock KSampler or any other node that
runs the same loaded model must find it as without SD Accel. In process through the node, on both ComfyUIs: the
state a GPU run leaves (weights converted, graphs captured over them) is set directly, as no capture runs here."""
import pytest
import torch
from torch import nn

import comfy_inproc


def _convs(model):
    return [m.weight for m in model.model.diffusion_model.modules() if isinstance(m, nn.Conv2d) and m.weight.dim() == 4]


def _model_cond_latent_and_stock(tmp_path):
    """The tiny model, a cond, a latent, and stock KSampler's result on them."""
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    import nodes
    dim = model.model.model_config.unet_config["context_dim"]
    cond = [[torch.randn(1, 77, dim, generator=torch.Generator().manual_seed(0)), {}]]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    with torch.inference_mode():
        ref = nodes.KSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)[0]["samples"]
    return model, cond, latent, ref


def _as_a_gpu_run_left_it(model, refused=None):
    """The weights channels_last, the model's state saying so, and a key whose probe found it capturable, as a
    GPU run's capture leaves them (`refused`: the key's capture failed for that reason instead)."""
    from sd_accel.engine.graphs import probe
    from sd_accel.engine.patches import patching
    from sd_accel.hosts.comfyui import accelerate
    st = accelerate._state(model.model)
    with torch.inference_mode():
        assert patching.convert_conv_weights(model.model.diffusion_model) > 0
    st.channels_last_done = st.channels_last_now = True
    v = st.graphs._verdict(("a key seen on the GPU",))
    v.probed, v.result = 2, probe.Verdict(refused)
    assert st.graphs.may_replay() is (refused is None)
    return st


def test_after_a_run_the_conv_weights_are_back_in_stock_layout_in_their_own_storage(tmp_path):
    model, cond, latent, ref = _model_cond_latent_and_stock(tmp_path)
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    with torch.inference_mode():
        SDAccelKSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
    st = _as_a_gpu_run_left_it(model)
    with torch.inference_mode():
        storages = [w.data_ptr() for w in _convs(model)]
        values = [w.detach().clone() for w in _convs(model)]
        out = SDAccelKSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
    assert not st.channels_last_now and st.channels_last_done
    assert all(w.is_contiguous() for w in _convs(model))
    assert [w.data_ptr() for w in _convs(model)] == storages
    assert all(torch.equal(w, v) for w, v in zip(_convs(model), values))
    torch.testing.assert_close(out["result"][0]["samples"], ref, atol=1e-4, rtol=1e-4)


def test_a_layout_change_outside_inference_mode_keeps_the_weights_fingerprint(tmp_path):
    """The node's run ends outside any inference_mode scope of its own: the weights put back must stay
    inference tensors as ComfyUI loaded them, or the graphs' fingerprint would change (a capture every run)."""
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    from sd_accel.engine.graphs.fingerprint import WeightsFingerprint
    from sd_accel.engine.patches import patching
    from sd_accel.hosts.comfyui import accelerate, conv_layout
    st = accelerate._state(model.model)
    with torch.inference_mode():
        patching.convert_conv_weights(model.model.diffusion_model)
    fp = WeightsFingerprint(model.model)
    before = fp.read()[0]
    st.channels_last_done = st.channels_last_now = True
    conv_layout.back_to_stock_layout(st)
    assert all(w.is_contiguous() for w in _convs(model))
    assert fp.read()[0] == before


def test_apply_sd_accel_then_stock_ksampler_puts_the_weights_back_where_the_host_has_run_wrappers(tmp_path):
    """Apply SD Accel's clone sampled by stock KSampler: no node of ours sees the run end. Current ComfyUI's
    OUTER_SAMPLE wrapper does; the 2024 ComfyUI has no hook around a sampling run, so there the weights stay
    in the layout the graphs were captured over (docs/cuda_graphs.md says so)."""
    model, cond, latent, ref = _model_cond_latent_and_stock(tmp_path)
    import nodes
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    with torch.inference_mode():
        patched = SDAccelApply().apply(model)["result"][0]
    st = _as_a_gpu_run_left_it(model)
    with torch.inference_mode():
        out = nodes.KSampler().sample(patched, 1, 2, 7.0, "euler", "normal", cond, cond, latent)[0]["samples"]
    back = hasattr(model, "add_wrapper_with_key")
    assert st.channels_last_now is not back
    spatial = [w for w in _convs(model) if w.shape[-1] > 1]   # a 1x1 kernel is contiguous in both layouts
    assert spatial and all(w.is_contiguous() is back for w in spatial)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _layouts_seen(model):
    """An input-block patch on `model` (a clone) recording, per UNet call, whether a 3x3 conv weight is
    channels_last."""
    conv = next(m for m in model.model.diffusion_model.modules() if isinstance(m, nn.Conv2d) and m.weight.shape[-1] > 1)
    seen = []

    def conv_layout_seen(h, transformer_options):
        seen.append(not conv.weight.is_contiguous())
        return h
    model.set_model_input_block_patch(conv_layout_seen)
    return seen


def test_steps_run_in_the_graphs_layout_only_while_the_model_may_replay_a_graph(tmp_path):
    """channels_last is for graphs: a model whose every key was refused (its capture failed) runs its eager steps
    in stock's layout, where ComfyUI's modules are faster; one with a key that captures keeps the graphs' layout
    for the run. On the CPU no graph runs, so the state a GPU run leaves is set directly."""
    model, cond, latent, ref = _model_cond_latent_and_stock(tmp_path)
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    for refused, expect_channels_last in ((None, True), ("capture failed (a test's reason)", False)):
        clone = model.clone()
        seen = _layouts_seen(clone)
        _as_a_gpu_run_left_it(clone, refused)
        with torch.inference_mode():
            out = SDAccelKSampler().sample(clone, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
        assert seen and all(s is expect_channels_last for s in seen), (refused, seen)
        assert all(w.is_contiguous() for w in _convs(model))   # after the run, stock's layout either way
        torch.testing.assert_close(out["result"][0]["samples"], ref, atol=1e-4, rtol=1e-4)


def test_under_force_channels_last_stocks_layout_stays_channels_last(tmp_path, monkeypatch):
    """ComfyUI's --force-channels-last loads the UNet's conv weights channels_last, and stock KSampler runs on that
    layout: SD Accel's runs leave it so (put "back" to contiguous, stock's next runs met another layout than
    without SD Accel), and our graphs, captured over channels_last, need no conversion."""
    comfy_inproc.fixtures_module()    # ComfyUI importable
    import comfy.cli_args
    import comfy.model_management as mm
    if not hasattr(mm, "force_channels_last"):
        pytest.skip("this ComfyUI (2024) has no --force-channels-last")
    monkeypatch.setattr(comfy.cli_args.args, "force_channels_last", True)
    model, cond, latent, ref = _model_cond_latent_and_stock(tmp_path)
    spatial = [w for w in _convs(model) if w.shape[-1] > 1]
    assert spatial and not any(w.is_contiguous() for w in spatial), "ComfyUI did not load the UNet channels_last"
    from sd_accel.engine.graphs import probe
    from sd_accel.hosts.comfyui import accelerate
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    st = accelerate._state(model.model)
    st.channels_last_done = st.channels_last_now = True    # as a GPU run's capture leaves it
    v = st.graphs._verdict(("a key seen on the GPU",))
    v.probed, v.result = 2, probe.Verdict(None)
    with torch.inference_mode():
        storages = [w.data_ptr() for w in spatial]
        out = SDAccelKSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)
        again = nodes_ksampler(model, cond, latent)
    assert all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in spatial), \
        "the weights were left out of stock's layout"
    assert st.channels_last_now
    assert [w.data_ptr() for w in spatial] == storages
    torch.testing.assert_close(out["result"][0]["samples"], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, ref, atol=0, rtol=0)


def nodes_ksampler(model, cond, latent):
    import nodes
    return nodes.KSampler().sample(model, 1, 2, 7.0, "euler", "normal", cond, cond, latent)[0]["samples"]
