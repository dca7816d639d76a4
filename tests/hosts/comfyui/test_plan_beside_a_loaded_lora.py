"""A plan made while another clone of the same model is loaded with a LoRA (its patched weights in the shared
model, ComfyUI's originals in its backup) must not carry that LoRA: ComfyUI swaps the weights back when it loads
our clone, and our stand-ins must then compute with the originals, not the patched tensors they saw at planning.
In process, through ComfyUI's own LoRA loading, on both ComfyUIs."""
import torch

import comfy_inproc


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _forward(patcher):
    import comfy.model_management as mm
    mm.unload_all_models()      # on a CPU-only machine a loaded clone's weights would stay for the next clone
    mm.load_models_gpu([patcher])
    x, t, ctx = comfy_inproc.unet_inputs(patcher.model.diffusion_model)
    with torch.inference_mode():
        return patcher.model.apply_model(x, t, c_crossattn=ctx).float()


def test_a_plan_made_beside_a_loaded_lora_clone_never_carries_its_lora(tmp_path):
    model = comfy_inproc.tiny_model_patcher(tmp_path / "ckpt")     # ComfyUI importable from here on
    import comfy.sd
    import comfy.utils
    from sd_accel.hosts.comfyui import accelerate as host
    lora_path = str(tmp_path / "lora.safetensors")
    comfy_inproc.fixtures_module().build_lora(comfy_inproc.COMFY, "tiny", lora_path, seed=4, scale=0.05)
    lora = comfy.utils.load_torch_file(lora_path)
    base = _forward(model)
    with_lora_clone = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    with_lora = _forward(with_lora_clone)          # stays loaded: its patched weights are in the shared model
    ours, info = host.accelerate(model, host.AccelOptions())
    assert info["patched"].get("group_norm_silu"), info["patched"]   # stand-ins were planned, beside the LoRA
    out = _forward(ours)
    assert _rel(with_lora, base) > 0.05, "the LoRA moves the output too little to test"
    assert _rel(out, base) < 1e-3, (_rel(out, base), _rel(out, with_lora))
