"""Clones of one model that would get the same module swaps get the same modules (hosts/comfyui/plan_reuse.py), so
the graphs' weights fingerprint reads one tree whichever of them ComfyUI has loaded, and a switch between them keeps
the graphs; a clone whose plan would differ gets its own. In process, through ComfyUI's own loading, on both
ComfyUIs."""
import torch

import comfy_inproc


def _ours(patcher):
    """{path: module} of SD Accel's object patches on an accelerated clone."""
    from sd_accel.hosts.comfyui import object_patches
    return {k: m for k, m in patcher.object_patches.items() if object_patches.is_ours(m)}


def _same_modules(a, b):
    ours_a, ours_b = _ours(a), _ours(b)
    return bool(ours_a) and ours_a.keys() == ours_b.keys() and all(ours_a[k] is ours_b[k] for k in ours_a)


def _tree_when_loaded(patcher):
    """The weights fingerprint of the model's tree with `patcher` loaded (its object patches applied)."""
    import comfy.model_management as mm
    from sd_accel.engine.graphs.fingerprint import WeightsFingerprint
    mm.unload_all_models()
    mm.load_models_gpu([patcher])
    base = patcher.model
    return WeightsFingerprint(base, base.diffusion_model).read()[0]


def _freeu_like(model):
    """A patch node's clone: an output-block patch of its own (FreeU's kind), no module of its own."""
    clone = model.clone()
    clone.set_model_output_block_patch(lambda h, hsp, transformer_options: (h, hsp))
    return clone


def test_alike_clones_get_the_same_modules_and_keep_one_tree(tmp_path):
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    from sd_accel.hosts.comfyui import accelerate as host
    plain, info = host.accelerate(model, host.AccelOptions())
    assert info["patched"].get("group_norm_silu"), info["patched"]
    patched, info2 = host.accelerate(_freeu_like(model), host.AccelOptions())
    assert patched is not plain and info2["patched"] == info["patched"]
    assert _same_modules(plain, patched)
    # options that do not shape the plan share it; the host's own loads see one tree for both clones
    no_graphs, _ = host.accelerate(model, host.AccelOptions(cuda_graph=False))
    assert _same_modules(plain, no_graphs)
    assert _tree_when_loaded(plain) == _tree_when_loaded(patched)


def test_a_clone_whose_plan_would_differ_gets_its_own(tmp_path):
    model = comfy_inproc.tiny_model_patcher(tmp_path)
    from sd_accel.hosts.comfyui import accelerate as host
    plain, _ = host.accelerate(model, host.AccelOptions())
    tree = _tree_when_loaded(plain)
    # another pack's object patch on a block: planned around it
    theirs = model.clone()
    unet = model.model.diffusion_model
    theirs.add_object_patch("diffusion_model.out", torch.nn.Sequential(*unet.out))
    other, _ = host.accelerate(theirs, host.AccelOptions())
    assert not _same_modules(plain, other)
    # a pack that swapped a module inside a block in place, or hooked one, since the first plan (in the model's own
    # tree: no clone of ours loaded)
    import comfy.model_management as mm
    mm.unload_all_models()
    norm = unet.input_blocks[1][0].in_layers[0]
    swapped = torch.nn.GroupNorm(norm.num_groups, norm.num_channels, eps=norm.eps)
    swapped.load_state_dict(norm.state_dict())
    unet.input_blocks[1][0].in_layers[0] = swapped
    after_swap, _ = host.accelerate(_freeu_like(model), host.AccelOptions())
    assert not _same_modules(plain, after_swap)
    hooked = unet.middle_block[0].in_layers[0]
    handle = hooked.register_forward_hook(lambda m, args, out: None)
    try:
        after_hook, _ = host.accelerate(_freeu_like(model), host.AccelOptions())
        assert not _same_modules(after_swap, after_hook)
    finally:
        handle.remove()
    assert _tree_when_loaded(after_swap) != tree


def _forward(patcher):
    import comfy.model_management as mm
    mm.unload_all_models()
    mm.load_models_gpu([patcher])
    x, t, ctx = comfy_inproc.unet_inputs(patcher.model.diffusion_model)
    with torch.inference_mode():
        return patcher.model.apply_model(x, t, c_crossattn=ctx).float()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_clones_sharing_a_plan_each_compute_with_their_own_weights(tmp_path):
    """A LoRA clone and the plain model share one plan (the same stand-ins); ComfyUI patches each clone's weights in at
    its load, through whatever stands in the tree, and takes them out at the next load. Each must compute with its
    own weights, in any order: the stand-ins share the originals' parameter tables, so no patched tensor stays behind
    in a shared module. The patches reach Linear weights (the LoRA) and a GroupNorm weight that a fused stand-in
    holds (a diff patch, as a full fine-tune's difference or a LyCORIS norm gives)."""
    model = comfy_inproc.tiny_model_patcher(tmp_path / "ckpt")
    import comfy.sd
    import comfy.utils
    from sd_accel.hosts.comfyui import accelerate as host
    lora_path = str(tmp_path / "lora.safetensors")
    comfy_inproc.fixtures_module().build_lora(comfy_inproc.COMFY, "tiny", lora_path, seed=4, scale=0.05)
    lora = comfy.sd.load_lora_for_models(model, None, comfy.utils.load_torch_file(lora_path), 1.0, 0)[0]
    norm_key = "diffusion_model.input_blocks.1.0.in_layers.0.weight"
    norm = model.model.diffusion_model.input_blocks[1][0].in_layers[0].weight
    lora.add_patches({norm_key: (torch.full_like(norm, 0.5),)}, 1.0)
    stock_plain, stock_lora = _forward(model), _forward(lora)
    assert _rel(stock_lora, stock_plain) > 0.05, "the patches move the output too little to test"
    ours_lora, info = host.accelerate(lora, host.AccelOptions())
    ours_plain, _ = host.accelerate(model, host.AccelOptions())
    assert info["patched"].get("group_norm_silu") and _same_modules(ours_lora, ours_plain)
    for patcher, want in ((ours_lora, stock_lora), (ours_plain, stock_plain), (ours_lora, stock_lora)):
        got = _forward(patcher)
        assert _rel(got, want) < 1e-3, (_rel(got, want), _rel(got, stock_plain), _rel(got, stock_lora))
    assert _rel(_forward(model), stock_plain) < 1e-6, "stock's model after ours"
