"""Host layers that compute otherwise than the plain op over their cast weights, through real ComfyUI in process
(CPU, the fused kernels in Triton's interpreter).

A scaled-fp8 checkpoint (ComfyUI's `scaled_fp8` format: fp8 Linear weights, each with its `scale_weight`; ComfyUI's
own CheckpointSave writes one for such a model, and fp8_scaled releases ship them) is computed by ComfyUI's
scaled_fp8 Linear as weight x scale. SD Accel computes the ResBlocks' timestep-embedding projections itself, all of
them in one GEMM from the weights as read: over a scaled layer that GEMM must not run, or every ResBlock adds an
embedding off by its layer's scale. ComfyUI's fp8_ops Linear (UNETLoader's fp8_e4m3fn_fast on a GPU with FP8
compute) multiplies in FP8 in eval mode: a layer of that class runs its own forward there, never an fp16 copy of SD
Accel's.
ComfyUI 2024 has neither (no scaled fp8, no fp8_ops): skipped there.
"""
import pytest
import torch

import comfy_inproc

PREFIX = "model.diffusion_model."


def _scaled_fp8_state_dict(folder):
    """The tiny checkpoint with every UNet Linear weight stored as float8_e4m3fn over a per-layer scale well away
    from 1 (as a scaled-fp8 conversion stores it), and the `scaled_fp8` marker ComfyUI detects."""
    path = comfy_inproc.tiny_checkpoint(folder)
    import comfy.utils
    sd = comfy.utils.load_torch_file(path)
    scaled = 0
    for key in [k for k in sd if k.startswith(PREFIX) and k.endswith(".weight") and sd[k].dim() == 2]:
        w = sd[key].float()
        scale = w.abs().max() / 448.0 * 8.0     # an fp8 range of 56 for the layer: weight / scale within it
        sd[key] = (w / scale).to(torch.float8_e4m3fn)
        sd[key[:-len("weight")] + "scale_weight"] = scale.reshape(())
        scaled += 1
    sd[PREFIX + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return sd, scaled


def _load(sd):
    import comfy.ops
    import comfy.sd
    if not hasattr(comfy.ops, "scaled_fp8_ops") or not hasattr(comfy.sd, "load_state_dict_guess_config"):
        pytest.skip("this ComfyUI (2024) has no scaled fp8 checkpoints")
    with torch.inference_mode():
        return comfy.sd.load_state_dict_guess_config(sd, output_vae=False, output_clip=False)[0]


def test_a_scaled_fp8_checkpoint_samples_stock_image_with_the_fused_modules(tmp_path):
    sd, scaled = _scaled_fp8_state_dict(tmp_path)
    model = _load(sd)
    import comfy.model_management as mm
    from sd_accel.engine.patches import emb_projections
    from sd_accel.hosts.comfyui import accelerate as host
    dm = model.model.diffusion_model
    linears = [m for m in dm.modules() if getattr(m, "scale_weight", None) is not None]
    assert len(linears) == scaled and all(m.weight.dtype == torch.float8_e4m3fn for m in linears), \
        "ComfyUI did not load the checkpoint as scaled fp8"
    ref = comfy_inproc.sample_tiny(model, steps=2, cfg=5.0)
    mm.unload_all_models()
    ours, info = host.accelerate(model, host.AccelOptions(cuda_graph=False, channels_last=False))
    assert info["patched"].get("resblock_add_norm"), info["patched"]
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
    mm.unload_all_models()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-3, "ours moved %.3g from stock's latent" % err
    resblocks = [m for m in dm.modules() if hasattr(m, "emb_layers")]
    assert resblocks and not any(emb_projections.batchable(b) for b in resblocks), \
        "a ResBlock over a scaled Linear is planned into the shared timestep-embedding GEMM"


def test_a_layer_of_a_host_class_computing_in_fp8_keeps_its_forward_where_it_would(tmp_path, monkeypatch):
    """An fp8-stored layer of ComfyUI's fp8_ops class multiplies in FP8 in eval mode only; in training mode, which
    ComfyUI leaves a loaded UNet in, it casts and calls F.linear like its manual-cast twin. In eval mode it gets no
    fp16-copy forward; in training mode it gets one, which computes the host's values and, once the layer is put
    in eval mode, hands the call to the host's FP8 multiply."""
    comfy_inproc.fixtures_module()    # ComfyUI importable
    import comfy.ops
    if not hasattr(comfy.ops, "fp8_ops"):
        pytest.skip("this ComfyUI (2024) has no fp8_ops")
    from sd_accel.engine.fp8 import upcast
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.hosts.comfyui import host_casts
    host_casts.register()
    torch.manual_seed(0)
    fast = comfy.ops.fp8_ops.Linear(8, 8, dtype=torch.float8_e4m3fn)
    plain = comfy.ops.manual_cast.Linear(8, 8, dtype=torch.float8_e4m3fn)
    for m in (fast, plain):
        with torch.no_grad():
            m.weight.copy_(torch.randn(8, 8).to(torch.float8_e4m3fn))
            m.bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
        m.comfy_cast_weights = True
    assert fm.computes_plainly(plain) and not fm.computes_plainly(fast)   # no fused module reads it
    assert fm.computes_plainly_in_training(fast) and not fm.computes_plainly_in_training(plain)
    root = torch.nn.ModuleDict({"fast": fast, "plain": plain})

    fast.eval()
    assert not upcast.is_fp8_stored(fast) and upcast.is_fp8_stored(plain)
    assert list(upcast.plan_upcast(root)[0]) == ["plain.forward"]

    fast.train()
    assert upcast.is_fp8_stored(fast)
    planned, _ = upcast.plan_upcast(root)
    assert sorted(planned) == ["fast.forward", "plain.forward"], list(planned)
    fp8_calls = []

    def spy(module, x):     # the host's FP8 multiply, counted; declining (None), it makes the host cast instead
        fp8_calls.append(module)
        return None
    monkeypatch.setattr(comfy.ops, "fp8_linear", spy)
    x = torch.randn(2, 3, 8)
    stock = fast(x)                                      # the host's own forward, in training mode
    fast.forward = planned["fast.forward"]
    assert torch.equal(fast(x), stock) and not fp8_calls
    fast.eval()
    fast(x)
    assert fp8_calls == [fast]                           # eval mode: the host's FP8 path, not the fp16 copy


def test_a_fast_fp8_unet_shares_the_timestep_gemm_in_training_mode_only(tmp_path, monkeypatch):
    """A UNet of ComfyUI's fp8_ops Linears (UNETLoader's fp8_e4m3fn_fast on a GPU with FP8 compute; made here as that
    load makes them: the class, fp8 weights cast per call). In training mode, where ComfyUI leaves a loaded UNet,
    they compute the plain op: the ResBlocks' timestep-embedding projections run as one shared GEMM over their
    weights, and ours is stock's latent. In eval mode each ResBlock calls its own Linear, whose forward multiplies
    in FP8, as stock's do."""
    comfy_inproc.fixtures_module()    # ComfyUI importable
    import comfy.ops
    if not hasattr(comfy.ops, "fp8_ops"):
        pytest.skip("this ComfyUI (2024) has no fp8_ops")
    import comfy.model_management as mm
    from sd_accel.engine.patches import emb_projections
    from sd_accel.hosts.comfyui import accelerate as host
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    dm = model.model.diffusion_model
    with torch.no_grad():
        for m in [m for m in dm.modules() if isinstance(m, torch.nn.Linear)]:
            m.__class__ = comfy.ops.fp8_ops.Linear
            m.weight = torch.nn.Parameter(m.weight.to(torch.float8_e4m3fn), requires_grad=False)
            m.comfy_cast_weights = True
    assert model.model.training and dm.training
    emb_linears = {id(m.emb_layers[1]) for m in dm.modules() if hasattr(m, "emb_layers")}
    shared_gemms, fp8_calls = [], []
    real_all = emb_projections.EmbProjections._all

    def counted_all(self, emb):
        shared_gemms.append(emb.shape)
        return real_all(self, emb)

    def declined(module, x):    # the host's FP8 multiply (no FP8 GEMM on this CPU): noted, then the host casts
        fp8_calls.append(id(module))
        return None
    monkeypatch.setattr(emb_projections.EmbProjections, "_all", counted_all)
    monkeypatch.setattr(comfy.ops, "fp8_linear", declined)

    ref = comfy_inproc.sample_tiny(model, steps=2, cfg=5.0)
    mm.unload_all_models()
    ours, info = host.accelerate(model, host.AccelOptions(cuda_graph=False, channels_last=False))
    assert info["patched"].get("resblock_add_norm"), info["patched"]
    resblocks = [m for m in dm.modules() if hasattr(m, "emb_layers")]
    assert resblocks and all(emb_projections.batchable(b) for b in resblocks)
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
    mm.unload_all_models()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-3, "ours moved %.3g from stock's latent" % err
    assert shared_gemms and not fp8_calls, (len(shared_gemms), len(fp8_calls))

    model.model.eval()
    try:
        comfy_inproc.sample_tiny(model, steps=2, cfg=5.0)
        mm.unload_all_models()
        stock_calls, fp8_calls[:] = set(fp8_calls), []
        shared_gemms.clear()
        comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
        mm.unload_all_models()
    finally:
        model.model.train()
    assert emb_linears <= stock_calls, "stock's eval mode did not reach its FP8 multiply"
    assert not shared_gemms and set(fp8_calls) == stock_calls, (len(shared_gemms), len(set(fp8_calls)),
                                                                 len(stock_calls))


def _dequantizing_ops():
    """An ops class with ComfyUI-GGUF's mechanism (its UnetLoaderGGUF loads SD1.5/SDXL UNets this way): subclasses of
    ComfyUI's manual_cast classes whose loaded weights are stored quantized (here int8 over a per-layer scale, for
    GGUF its quantized blocks) and whose own `forward_comfy_cast_weights` dequantizes them; ComfyUI's plain cast of
    such a weight reads the stored values, not the weight."""
    import comfy.ops

    class Quantized:
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
            w = self.weight.detach().float()
            self.qscale = float(w.abs().max()) / 127.0 or 1.0
            self.weight = torch.nn.Parameter(torch.round(w / self.qscale).to(torch.int8), requires_grad=False)

        def dequantized(self, x):
            w = (self.weight.float() * self.qscale).to(x.dtype)
            return w, None if self.bias is None else self.bias.to(x.dtype)

    class Ops(comfy.ops.manual_cast):
        class Linear(Quantized, comfy.ops.manual_cast.Linear):
            def forward_comfy_cast_weights(self, x):
                return torch.nn.functional.linear(x, *self.dequantized(x))

        class Conv2d(Quantized, comfy.ops.manual_cast.Conv2d):
            def forward_comfy_cast_weights(self, x):
                return self._conv_forward(x, *self.dequantized(x))

        class GroupNorm(Quantized, comfy.ops.manual_cast.GroupNorm):
            def forward_comfy_cast_weights(self, x):
                return torch.nn.functional.group_norm(x, self.num_groups, *self.dequantized(x), self.eps)

        class LayerNorm(Quantized, comfy.ops.manual_cast.LayerNorm):
            def forward_comfy_cast_weights(self, x):
                return torch.nn.functional.layer_norm(x, self.normalized_shape, *self.dequantized(x), self.eps)
    return Ops


def test_a_unet_of_another_packs_dequantizing_ops_samples_stock_image(tmp_path):
    """Every layer of the UNet is of the dequantizing ops class: no fused module may read its weights (a fused
    GroupNorm, LayerNorm or ResBlock reading them through ComfyUI's plain cast computed with the stored int8
    values); the run is stock's."""
    path = comfy_inproc.tiny_checkpoint(tmp_path)    # (and ComfyUI importable)
    import comfy.sd
    import comfy.utils
    if not hasattr(comfy.sd, "load_state_dict_guess_config") or \
            "model_options" not in comfy.sd.load_state_dict_guess_config.__code__.co_varnames:
        pytest.skip("this ComfyUI (2024) takes no custom operations at load")
    sd = comfy.utils.load_torch_file(path)
    with torch.inference_mode():
        model = comfy.sd.load_state_dict_guess_config(sd, output_vae=False, output_clip=False,
                                                      model_options={"custom_operations": _dequantizing_ops()})[0]
    import comfy.model_management as mm
    from sd_accel.hosts.comfyui import accelerate as host
    dm = model.model.diffusion_model
    assert any(m.weight is not None and m.weight.dtype == torch.int8 for m in dm.modules()
               if isinstance(m, torch.nn.GroupNorm)), "ComfyUI did not load the UNet with the dequantizing ops"
    ref = comfy_inproc.sample_tiny(model, steps=2, cfg=5.0)
    mm.unload_all_models()
    ours, info = host.accelerate(model, host.AccelOptions(cuda_graph=False, channels_last=False))
    got = comfy_inproc.sample_tiny(ours, steps=2, cfg=5.0)
    mm.unload_all_models()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-3, "ours moved %.3g from stock's latent" % err
    reading = {"group_norm", "group_norm_silu", "layer_norm", "resblock_add_norm", "transformer_add_norm"}
    assert not reading & set(info["patched"]), info["patched"]
