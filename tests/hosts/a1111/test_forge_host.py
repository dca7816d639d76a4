"""hosts/forge.py against the stand-in of Forge's backend (fake_forge/): Forge's Linear in GEGLU, object
patches put in and taken out by the memory manager, Forge's LoRA loader, the model_function_wrapper slot."""
import gc
import weakref

import torch

from sd_accel.engine.patches import fused_modules
from sd_accel.engine.reports import kernel_report
from sd_accel.hosts import forge, forge_plan, webui

import regional_prompter_standin
from forge_util import denoise, make_patcher, norm_and_geglu_lora

ON = webui.WebUIOptions()
ALL = {"group_norm_silu": 11, "silu_folded": 11, "group_norm": 4, "layer_norm": 12, "geglu": 4, "resblock": 5}


def live_fused(patcher):
    return sum(1 for m in patcher.model.diffusion_model.modules() if fused_modules.is_fused(m))


def test_default_options_run_every_fused_module_and_match_stock(fake_forge, stock_kernels):
    """With the default settings every fused module is in the run's UNet (GEGLU on Forge's Linear too),
    each is called on every step, and the result is stock Forge's."""
    base = make_patcher()
    ref = denoise(base)
    clone, info = forge.accelerate(base, ON)
    assert info["counts"] == ALL and info["patched"] == sum(ALL.values())
    assert info["wrapper"] == "model_function_wrapper" and info["fold_silu"] is True
    assert base.object_patches == {} and "model_function_wrapper" not in base.model_options
    for steps in (1, 2):
        before = kernel_report.snapshot()
        out = denoise(clone)
        ran = webui.kernel_summary(before)
        # a ResBlock's out norm (+SiLU) runs inside the ResBlock stand-in, with the embedding added in it
        assert {op: e["fused"] + e["fallback"] for op, e in ran.items()} == {
            "group_norm_silu": 6, "group_norm": 4, "layer_norm": 12, "geglu": 4, "resblock_add_norm": 5,
            "resblock_bias_residual": 5}, steps
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert live_fused(clone) == sum(ALL.values())
    g = forge.status(type("M", (), {"forge_objects": type("F", (), {"unet": clone})})())["graphs"]
    assert g["eager"] == 2 and g["last_eager_reason"] == "no CUDA device"


def test_unload_puts_forge_modules_back(fake_forge, stock_kernels):
    from backend import memory_management
    base = make_patcher()
    orig = dict(base.model.named_modules())
    clone, _ = forge.accelerate(base, ON)
    denoise(clone)
    memory_management.unload_all()
    now = dict(base.model.named_modules())
    assert now.keys() == orig.keys() and all(now[k] is orig[k] for k in orig)
    assert live_fused(base) == 0


def test_a_lora_on_replaced_modules_survives_toggling(fake_forge, stock_kernels):
    """Forge's LoRA loader puts a merged Parameter on whichever module stands at the path and reloads only
    when the LoRA set changes: the LoRA must hold with SD Accel on, then off, then on again."""
    base = make_patcher()
    delta = norm_and_geglu_lora(base.model.diffusion_model)
    plain = make_patcher()   # the same weights (seed), stock, for the references
    ref_lora = plain.clone()
    ref_lora.add_patches(filename="l.safetensors", patches=delta)
    want = denoise(ref_lora)
    from backend import memory_management
    memory_management.unload_all()
    want_plain = denoise(plain)
    memory_management.unload_all()

    with_lora = base.clone()
    with_lora.add_patches(filename="l.safetensors", patches=delta)
    on, _ = forge.accelerate(with_lora, ON)
    torch.testing.assert_close(denoise(on), want, atol=2e-5, rtol=1e-4)
    off = forge.strip(with_lora.clone())          # SD Accel off, same LoRA: no reload in Forge
    torch.testing.assert_close(denoise(off), want, atol=2e-5, rtol=1e-4)
    again, _ = forge.accelerate(with_lora, ON)
    torch.testing.assert_close(denoise(again), want, atol=2e-5, rtol=1e-4)
    no_lora, _ = forge.accelerate(base, ON)       # LoRA removed: Forge puts the backups back
    torch.testing.assert_close(denoise(no_lora), want_plain, atol=2e-5, rtol=1e-4)


def test_group_norm_wrapper_means_no_folded_silu(fake_forge, stock_kernels):
    base = make_patcher()
    base.set_group_norm_wrapper(lambda norm, x, to: norm(x))
    _, info = forge.accelerate(base, ON)
    assert info["fold_silu"] is False
    assert info["counts"] == {"group_norm": 15, "layer_norm": 12, "geglu": 4}


def test_manual_cast_modules_stay_with_forge_and_lowvram_matches(fake_forge, stock_kernels):
    """Modules Forge casts per call are left to it; replacements have no `parameters_manual_cast`, so
    Forge's lowvram swap keeps them whole instead of asking them to cast."""
    base = make_patcher()
    unet = base.model.diffusion_model
    ln = next(n for n, m in unet.named_modules() if n.endswith("norm1"))
    unet.get_submodule(ln).parameters_manual_cast = True
    ref = denoise(base)
    from backend import memory_management
    memory_management.unload_all()
    clone, info = forge.accelerate(base, ON)
    assert info["skipped"] == {"Forge casts it on the fly": 1} and info["counts"]["layer_norm"] == 11
    torch.testing.assert_close(denoise(clone, lowvram=True), ref, atol=2e-5, rtol=1e-4)
    assert not any(hasattr(m, "parameters_manual_cast") for m in clone.object_patches.values())
    proj = next(m for n, m in unet.named_modules() if n.endswith("ff.net.0.proj"))
    assert proj.parameters_manual_cast is True   # Forge's own Linear, inside the fused GEGLU, does cast


def test_online_lora_stays_with_forge_and_runs_eager(fake_forge, stock_kernels):
    base = make_patcher()
    delta = norm_and_geglu_lora(base.model.diffusion_model)
    base.add_patches(filename="online.safetensors", patches=delta, online_mode=True)
    ref = denoise(base)
    from backend import memory_management
    memory_management.unload_all()
    clone, info = forge.accelerate(base, ON)
    norms = {k[len("diffusion_model."):].rpartition(".")[0] for k in delta if not k.endswith("proj.weight")}
    # a ResBlock stand-in reads its norms' weights itself: one holding a LoRA'd norm stays Forge's too
    planned = forge_plan.state_of(base.model).variants[True]
    blocks = {p for p, m in planned.items() if fused_modules.kind_of(m) == "resblock"
              and any(n.startswith(p + ".") for n in norms)}
    assert blocks and info["skipped"]["online LoRA"] == len(norms) + len(blocks) and info["cuda_graph"] is False
    assert not (norms | blocks) & {k[len("diffusion_model."):] for k in clone.object_patches}
    torch.testing.assert_close(denoise(clone), ref, atol=2e-5, rtol=1e-4)


def test_foreign_wrapper_is_chained_and_reapplying_is_idempotent(fake_forge, stock_kernels):
    """Another extension's model_function_wrapper set before ours runs, with ours inside; accelerating our
    own clone again (Forge's hires pass calls process_before_every_sampling on it) changes nothing."""
    base = make_patcher()
    ref = denoise(base)
    calls = []

    def theirs(apply_model, a):
        calls.append(1)
        return apply_model(a["input"], a["timestep"], **a["c"])
    base.set_model_unet_function_wrapper(theirs)
    clone, info = forge.accelerate(base, ON)
    assert info["wrapper"] == "model_function_wrapper (chained)"
    again, info2 = forge.accelerate(clone, ON)
    assert info2["wrapper"] == "model_function_wrapper (chained)"
    assert again.model_options["model_function_wrapper"].sd_accel_prev is theirs
    assert again.object_patches.keys() == clone.object_patches.keys()
    assert all(again.object_patches[k] is v for k, v in clone.object_patches.items())
    torch.testing.assert_close(denoise(again), ref, atol=2e-5, rtol=1e-4)
    assert calls == [1]
    assert forge.strip(again).model_options["model_function_wrapper"] is theirs


def test_a_tiling_wrapper_set_before_ours_runs_each_tile_through_our_step(fake_forge, stock_kernels):
    """Forge's MultiDiffusion (a built-in, so it runs before SD Accel) sets a model_function_wrapper that calls the
    UNet once per batch of tiles: each of those calls goes through SD Accel's step, and the result is Forge's own
    with that wrapper."""
    base = make_patcher()

    def tiles(apply_model, a):   # two halves of the latent's width, one UNet call each
        x, halves = a["input"], []
        w = x.shape[-1] // 2
        for sl in (slice(0, w), slice(w, None)):
            halves.append(apply_model(x[..., sl], a["timestep"], **a["c"]))
        return torch.cat(halves, dim=-1)
    base.set_model_unet_function_wrapper(tiles)
    ref = denoise(base)
    st = forge_plan.state_of(base.model)
    clone, info = forge.accelerate(base, ON)
    before = st.wrapper_calls
    assert info["wrapper"] == "model_function_wrapper (chained)"
    torch.testing.assert_close(denoise(clone), ref, atol=2e-5, rtol=1e-4)
    assert st.wrapper_calls - before == 2


def test_a_wrapper_set_after_ours_gets_the_eager_path_and_forge_s_layout(fake_forge, stock_kernels, monkeypatch):
    """An extension loaded after SD Accel sets its model_function_wrapper on SD Accel's clone, replacing SD Accel's
    step: the UNet's calls still take the eager path (held to Forge's own modules here, as a measured choice of
    them would: no fused kernel runs), conv weights an earlier run left channels_last go back to Forge's layout, and the result is
    Forge's with that wrapper. SD Accel off, the hooks leave the calls alone."""
    from backend import memory_management
    base = make_patcher()
    unet = base.model.diffusion_model

    def theirs(apply_model, a):
        return apply_model(a["input"], a["timestep"], **a["c"]) * 0.5
    plain = base.clone()
    plain.set_model_unet_function_wrapper(theirs)
    ref = denoise(plain)
    memory_management.unload_all()
    clone, _ = forge.accelerate(base, ON)
    st = forge_plan.state_of(base.model)
    from sd_accel.engine.patches import patching
    patching.convert_conv_weights(unet)   # as an earlier run with CUDA graphs leaves them
    st.channels_last = True
    later = clone.clone()
    later.set_model_unet_function_wrapper(theirs)
    from sd_accel.engine.graphs import eager
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")
    before, stock_before = kernel_report.snapshot(), st.eager_paths.stock_calls if st.eager_paths else 0
    torch.testing.assert_close(denoise(later), ref, atol=2e-5, rtol=1e-4)
    assert st.outside_calls == 1 and st.wrapper_calls == 0
    assert st.eager_paths.stock_calls - stock_before == 1 and webui.kernel_summary(before) == {}
    assert st.channels_last is False and all(m.weight.is_contiguous() for m in unet.modules()
                                             if isinstance(m, torch.nn.Conv2d))
    memory_management.unload_all()
    off = forge.strip(later)
    torch.testing.assert_close(denoise(off), ref, atol=2e-5, rtol=1e-4)
    assert st.outside_calls == 1
    status = forge.status(type("M", (), {"forge_objects": type("F", (), {"unet": later})})())
    assert status["outside_step"] == {"calls": 1, "paths": {}}


def test_another_extensions_object_patch_is_left_alone(fake_forge, stock_kernels):
    base = make_patcher()
    block = "diffusion_model.input_blocks.1"
    theirs = base.model.diffusion_model.input_blocks[1]
    base.add_object_patch(block, theirs)
    clone, info = forge.accelerate(base, ON)
    assert clone.object_patches[block] is theirs
    assert not any(k.startswith(block + ".") for k in clone.object_patches)
    assert info["skipped"]["another extension's object patch"] > 0


def test_disabled_and_fused_off(fake_forge, stock_kernels):
    base = make_patcher()
    assert forge.strip(base) is base
    clone, info = forge.accelerate(base, webui.WebUIOptions(fused_kernels=False))
    assert info["patched"] == 0 and clone.object_patches == {} and info["wrapper"] == "model_function_wrapper"
    clone, info = forge.accelerate(base, webui.WebUIOptions(fused_kernels=True, cuda_graph=False,
                                                            channels_last=False))
    assert info["wrapper"] == "model_function_wrapper" and info["patched"] == sum(ALL.values())   # see below
    assert forge.strip(clone).object_patches == {}


def test_a_switched_out_model_is_freed(fake_forge, stock_kernels):
    """Checkpoint switch: Forge drops the old model; nothing of SD Accel's keeps it alive."""
    from backend import memory_management
    base = make_patcher()
    clone, _ = forge.accelerate(base, ON)
    denoise(clone)
    memory_management.unload_all()
    ref = weakref.ref(base.model)
    del base, clone
    gc.collect()
    assert ref() is None


def test_the_same_patcher_gets_the_same_clone(fake_forge, stock_kernels):
    """Forge gives the extensions the same patcher every generation while nothing changed: the same clone
    comes back, so Forge finds it loaded instead of unloading and reloading the model; a patcher changed
    in place (a LoRA added) gets a new one."""
    from backend import memory_management
    base = make_patcher()
    first, _ = forge.accelerate(base, ON)
    denoise(first)
    unpatched = []
    first.forge_unpatch_model = lambda *a, **k: unpatched.append(a)
    second, _ = forge.accelerate(base, ON)
    assert second is first
    denoise(second)
    assert unpatched == [] and memory_management.loaded == [first]
    base.add_patches(filename="l.safetensors", patches=norm_and_geglu_lora(base.model.diffusion_model))
    third, _ = forge.accelerate(base, ON)
    assert third is not first and third.lora_patches == base.lora_patches
    base.model_options["transformer_options"]["scale"] = 0.5   # changed in place: a plain value
    fourth, _ = forge.accelerate(base, ON)
    base.model_options["transformer_options"]["scale"] = 0.7
    fifth, _ = forge.accelerate(base, ON)
    assert fourth is not third and fifth is not fourth
    assert fifth.model_options["transformer_options"]["scale"] == 0.7


def test_other_models_are_left_to_forge(fake_forge, stock_kernels):
    """Forge also runs DiT models (Flux, SD3): SD Accel's patches and graph path are made for SD UNets."""
    import torch.nn as nn
    from backend.k_model import KModel
    from backend.patcher import UnetPatcher
    dit = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
    base = UnetPatcher(KModel(dit))
    clone, info = forge.accelerate(base, ON)
    assert clone is base and info["patched"] == 0 and info["skipped"] == {"not an SD1.x/SDXL UNet": 1}


def test_timestep_embedding_of_another_signature_is_left_alone():
    import types as t
    mod = t.ModuleType("flux_like")

    def timestep_embedding(t, dim, max_period=10000, time_factor=1000.0):
        return t * time_factor
    mod.timestep_embedding = timestep_embedding
    import sys
    sys.modules["flux_like"] = mod
    try:
        model = type("Flux", (torch.nn.Module,), {"__module__": "flux_like"})()
        with webui.capturable_timestep_embedding(model):
            assert mod.timestep_embedding is timestep_embedding
    finally:
        del sys.modules["flux_like"]


def test_a_group_norm_wrapper_set_after_the_plan_gets_forges_norm(fake_forge, stock_kernels):
    """An extension that sets a group_norm_wrapper after SD Accel planned (SiLU folded): Forge's ResBlock
    would call it with our fused norm+SiLU and skip the folded SiLU after it. Through our wrapper it gets
    Forge's own norm, and the SiLU follows: what stock Forge computes."""
    base = make_patcher()
    clone, info = forge.accelerate(base, webui.WebUIOptions(cuda_graph=False, channels_last=False))
    assert info["fold_silu"] and info["wrapper"] == "model_function_wrapper"
    seen = []

    def theirs(norm, x, to):
        seen.append(norm)
        return norm(x) * 0.5 + 0.1
    clone.set_group_norm_wrapper(theirs)
    got = {}

    def apply_model(x, t, **c):
        got.update(c)
        return x
    x = torch.randn(1, 32, 4, 4)
    clone.model_options["model_function_wrapper"](apply_model, {
        "input": x, "timestep": torch.ones(1), "c": {"transformer_options": clone.model_options["transformer_options"]},
        "cond_or_uncond": [0]})
    shim = got["transformer_options"]["group_norm_wrapper"]
    assert shim is not theirs and clone.model_options["transformer_options"]["group_norm_wrapper"] is theirs
    path = "diffusion_model.input_blocks.1.0.in_layers.0"
    fused, stock = clone.object_patches[path], base.model.get_submodule(path)
    assert fused.sdaccel_act == "silu"
    torch.testing.assert_close(shim(fused, x, {}), torch.nn.functional.silu(theirs(stock, x, {})))
    assert seen[0] is stock


def test_the_stock_path_of_forges_replacements_runs_forges_computation(fake_forge, stock_kernels):
    """Where the engine picks the stock modules (eager steps at shapes where the fused kernels do not pay), the
    replacements run stock's computation; they carry no `parameters_manual_cast`, which Forge's own norm forwards
    read (the real Forge raised AttributeError here), so they run torch's forward, Forge's for an uncast module."""
    from sd_accel.engine.patches import stock_path
    base = make_patcher()
    ref = denoise(base)
    clone, _ = forge.accelerate(base, ON)
    norms = [m for m in clone.object_patches.values() if fused_modules.kind_of(m) in ("group_norm", "layer_norm")]
    assert norms and all("parameters_manual_cast" not in m.__dict__ for m in norms)
    before = kernel_report.snapshot()
    with stock_path.stock_modules():
        out = denoise(clone)
    assert not webui.kernel_summary(before), "the fused kernels ran on the stock path"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_without_graphs_the_step_runs_the_eager_path_the_engine_chooses(fake_forge, stock_kernels, monkeypatch):
    """With CUDA graphs off, Forge's step runs whichever of the fused and Forge's own modules the engine's eager
    choice picks (on a GPU: the faster, measured per shape), not always the fused ones; either gives stock's
    result. Forced both ways here (a CPU has no timing to choose by)."""
    from sd_accel.engine.graphs import eager
    base = make_patcher()
    ref = denoise(base)
    clone, _ = forge.accelerate(base, webui.WebUIOptions(cuda_graph=False, channels_last=False))
    for path, fused_calls in (("stock", False), ("fused", True)):
        monkeypatch.setattr(eager, "FORCED_PATH", path)
        before = kernel_report.snapshot()
        out = denoise(clone)
        assert bool(webui.kernel_summary(before)) == fused_calls, path
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_forges_resblock_signature_is_fused_and_hands_a_group_norm_wrapper_forges_own_steps(fake_forge, stock_kernels):
    """Forge's ResBlock takes transformer_options (fake_forge/backend/resblock.py): the stand-in is planned for
    it, equals it without options, and with a group_norm_wrapper in the options runs Forge's own steps, each
    norm through the wrapper, as Forge would."""
    from backend.resblock import forge_shaped
    from sd_accel.engine.patches import fused_resblock
    unet = make_patcher().model.diffusion_model
    block = forge_shaped(unet.input_blocks[1][0])
    holder = torch.nn.ModuleDict({"block": block})
    standin = fused_resblock.plan_resblocks(holder)["block"]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, block.channels, 4, 4, generator=g)
    emb = torch.randn(2, unet.time_embed[0].out_features, generator=g)
    seen = []

    def wrapper(norm, h, options):
        seen.append(norm)
        return norm(h) * 1.5
    with torch.no_grad():
        before = kernel_report.snapshot()
        out = standin(x, emb, {})
        assert webui.kernel_summary(before)["resblock_add_norm"]["fused"] + webui.kernel_summary(before)[
            "resblock_add_norm"]["fallback"] == 1
        torch.testing.assert_close(out, block(x, emb, {}), atol=2e-5, rtol=1e-4)
        wrapped = standin(x, emb, {"group_norm_wrapper": wrapper})
        assert seen == [block.in_layers[0], block.out_layers[0]]
        torch.testing.assert_close(wrapped, block(x, emb, {"group_norm_wrapper": wrapper}), atol=2e-5, rtol=1e-4)
        assert not torch.allclose(wrapped, out)


def test_channels_last_only_with_graphs(fake_forge, stock_kernels, monkeypatch):
    """channels_last serves the graphs: without them the step runs on Forge's own layout (no layout stand-ins
    asked for), where Forge's eager kernels are fastest."""
    asked = []
    real = forge_plan.run_patches

    def spy(st, patcher, unet, fold, layout):
        asked.append(layout)
        return real(st, patcher, unet, fold, layout)
    monkeypatch.setattr(forge_plan, "run_patches", spy)
    base = make_patcher()
    base.load_device = torch.device("cuda")   # planned as for a CUDA run; nothing here runs on it
    forge.accelerate(base, ON)
    _, info = forge.accelerate(base, webui.WebUIOptions(cuda_graph=False))
    assert asked == [True, False] and info["cuda_graph"] is False


def test_turning_sd_accel_off_puts_the_conv_weights_back_in_forges_layout(fake_forge, stock_kernels):
    """A run with graphs leaves the conv weights channels_last (on a GPU; set here as it leaves them); the
    patcher handed to Forge with SD Accel off has them in Forge's layout, values and storage unchanged."""
    from sd_accel.engine.patches import patching
    base = make_patcher()
    unet = base.model.diffusion_model
    assert patching.convert_conv_weights(unet) > 0
    forge_plan.state_of(base.model).channels_last = True
    convs = [m.weight for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.dim() == 4]
    ptrs, values = [w.data_ptr() for w in convs], [w.detach().clone() for w in convs]
    assert forge.strip(base) is base
    assert all(w.is_contiguous() for w in convs) and [w.data_ptr() for w in convs] == ptrs
    assert all(torch.equal(w, v) for w, v in zip(convs, values))
    assert not forge_plan.state_of(base.model).channels_last


def test_once_every_key_is_refused_the_conv_weights_go_back_to_forges_layout(fake_forge, stock_kernels):
    """channels_last serves the graphs: a run whose keys were all refused (its capture failed, on a GPU) puts the
    conv weights back in Forge's layout at its next step, where the eager steps are faster; while a key can
    capture they stay channels_last. The state a GPU run leaves is set directly (no capture runs here)."""
    from sd_accel.engine.graphs import probe
    from sd_accel.engine.graphs.step_graphs import StepGraphs
    from sd_accel.engine.patches import patching
    for refused, stays in ((None, True), ("capture failed (a test's reason)", False)):
        base = make_patcher()
        ref = denoise(base)
        clone, _ = forge.accelerate(base, ON)
        unet = base.model.diffusion_model
        st = forge_plan.state_of(base.model)
        assert patching.convert_conv_weights(unet) > 0
        st.channels_last = True
        st.graphs = StepGraphs(base.model, name="test")
        v = st.graphs._verdict(("a key seen on the GPU",))
        v.probed, v.result = 2, probe.Verdict(refused)
        out = denoise(clone)
        spatial = [m.weight for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-1] > 1]
        assert st.channels_last is stays and all(w.is_contiguous() is not stays for w in spatial), refused
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_another_extensions_forwards_in_the_unet_send_forges_step_eager(fake_forge, stock_kernels):
    """Regional Prompter on Forge (its stand-in): its own forward on every cross-attention, switching prompts by a
    call counter. Forge's step runs such calls eagerly (a replay would keep the capture's side), Forge's image."""
    base = make_patcher()
    calls = []
    regional_prompter_standin.hook_forwards(base.model.diffusion_model, calls)
    ref = denoise(base)
    clone, _ = forge.accelerate(base, ON)
    calls.clear()
    torch.testing.assert_close(denoise(clone), ref, atol=2e-5, rtol=1e-4)
    g = forge.status(type("M", (), {"forge_objects": type("F", (), {"unet": clone})})())["graphs"]
    assert [r for r in g["refused"] if "set the forward of" in r and "attn2" in r], g


def test_forges_builtin_freeu_gets_sd_accels_filter_in_the_step(fake_forge, stock_kernels):
    """Forge's built-in FreeU (forge_freeu_standin: its own copy of the filter, in its module): the transformer
    options Forge's UNet gets in an accelerated step hold a copy of its patch on SD Accel's filter kernel
    (engine/patches/freeu_filter.py); the patchers' own options keep the extension's patch, and with the fused
    kernels off the step gets that patch itself."""
    import forge_freeu_standin
    base = make_patcher()
    patch = forge_freeu_standin.make_output_block_patch(32, 1.3, 1.4, 0.9, 0.2)
    base.set_model_output_block_patch(patch)
    for options, swapped in ((ON, True), (webui.WebUIOptions(fused_kernels=False), False)):
        clone, _ = forge.accelerate(base, options)
        seen, inner = [], clone.model.apply_model

        def recording(x, t, **c):
            seen.append(c["transformer_options"]["patches"]["output_block_patch"])
            return inner(x, t, **c)
        clone.model.apply_model = recording          # on the instance, for this denoise only
        try:
            denoise(clone)
        finally:
            del clone.model.apply_model
        (got,) = seen[-1]
        assert (got is not patch) == swapped, options
        if swapped:
            assert got.__code__ is patch.__code__ and got.__closure__ is patch.__closure__
            assert got.__globals__["Fourier_filter"] is not forge_freeu_standin.Fourier_filter
        assert clone.model_options["transformer_options"]["patches"]["output_block_patch"] == [patch]
