"""Test stand-in for Acly/comfyui-inpaint-nodes' Fooocus inpaint (nodes.py `InpaintHead`, `load_fooocus_patch`,
`calculate_weight_patched`, `inject_patched_calculate_weight`, `InpaintBlockPatch`, `ApplyFooocusInpaint`), the
inpainting Krita's AI Diffusion plugin and many ComfyUI graphs use on SD1.5/SDXL checkpoints:
  * a weight patch of a type ComfyUI does not know: every UNet weight gets a ("fooocus", (uint8 values, min, max))
    patch through `add_patches`, and the first Apply replaces `comfy.lora.calculate_weight` (module-wide, for every
    model from then on) with a function that adds those patches dequantized (values / 255 * (max - min) + min) and
    hands the others to ComfyUI's own;
  * an input block patch (`set_model_input_block_patch`) that adds the inpaint head's feature (a 3x3 conv of the
    latent mask and the masked latent, made once in Apply on the CPU) after input block 0. It keeps the feature
    moved to the call's device and repeated to its batch on the patch object and makes it again only when the
    shape changes: Python state set on the first call, read on every later one.
The stand-in's head and patch are random from a seed (the real ones are loaded from the Fooocus files by another
node); their shapes follow the model (the head's width is input block 0's). Current ComfyUI only: the pack needs
`comfy.lora.calculate_weight`, which ComfyUI 2024 does not have (the real pack refuses to import there; this
stand-in refuses at Apply, so the other stand-ins' server still starts). docs/other_packs.md. Used only by the
tests.
"""
import math

import torch
import torch.nn.functional as F

import comfy.lora

_state = {"original": None}


def _dequantized(value, weight):
    w, w_min, w_max = (v.to(weight.device, torch.float32) for v in value)
    return (w / 255.0) * (w_max - w_min) + w_min


def calculate_weight_patched(patches, weight, key, intermediate_dtype=torch.float32, original_weights=None):
    remaining = []
    for p in patches:
        alpha, v = p[0], p[1]
        if not (isinstance(v, tuple) and len(v) == 2 and v[0] == "fooocus"):
            remaining.append(p)
            continue
        if alpha != 0.0:
            w = _dequantized(v[1], weight)
            if w.shape == weight.shape:
                weight += alpha * w.to(weight.dtype)
    if remaining:
        # as the pack does: original_weights is not handed on
        return _state["original"](remaining, weight, key, intermediate_dtype)
    return weight


def _inject():
    if _state["original"] is None:
        _state["original"] = comfy.lora.calculate_weight
        comfy.lora.calculate_weight = calculate_weight_patched


class InpaintBlockPatch:
    def __init__(self, feature):
        self.inpaint_head_feature = feature
        self._inpaint_block = None

    def __call__(self, h, transformer_options):
        if transformer_options["block"][1] == 0:
            if self._inpaint_block is None or self._inpaint_block.shape != h.shape:
                batch = h.shape[0] // self.inpaint_head_feature.shape[0]
                self._inpaint_block = self.inpaint_head_feature.to(h).repeat(batch, 1, 1, 1)
            h = h + self._inpaint_block
        return h


def _random_patch(model, seed, spread):
    """{model key: ("fooocus", (uint8 values, min, max))} for every float UNet tensor: uniform in ±spread / sqrt(fan-in)
    for a layer's weight, ±spread / 10 for a vector. From the shapes only: the weights in the tree may be patched
    already (a clone loaded with its patches), and the patch, a file in the real pack, must not depend on them."""
    g = torch.Generator().manual_seed(seed)
    patch = {}
    for key, t in model.model.state_dict().items():
        if not key.startswith("diffusion_model.") or not t.is_floating_point():
            continue
        scale = spread / math.sqrt(t[0].numel()) if t.dim() > 1 else spread / 10
        values = torch.randint(0, 256, tuple(t.shape), generator=g, dtype=torch.uint8)
        patch[key] = ("fooocus", (values, torch.tensor(-scale), torch.tensor(scale)))
    return patch


class FooocusInpaintLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "latent": ("LATENT",), "seed": ("INT", {"default": 0, "min": 0}),
                             "spread": ("FLOAT", {"default": 0.05, "min": 0.0, "max": 1.0})}}

    def patch(self, model, latent, seed=0, spread=0.05):
        if not hasattr(comfy.lora, "calculate_weight"):
            raise RuntimeError("Fooocus inpaint needs comfy.lora.calculate_weight (a newer ComfyUI)")
        base = model.model
        pixels = base.process_latent_in(latent["samples"])
        latent_mask = F.max_pool2d(latent["noise_mask"].round(), (8, 8)).round().to(pixels)
        width = base.diffusion_model.input_blocks[0][0].out_channels
        head = torch.randn((width, 5, 3, 3), generator=torch.Generator().manual_seed(seed + 1)) * 0.1
        feed = torch.cat([latent_mask, pixels], dim=1)
        with torch.inference_mode():
            feature = F.conv2d(F.pad(feed, (1, 1, 1, 1), "replicate"), weight=head.to(feed))
        m = model.clone()
        m.set_model_input_block_patch(InpaintBlockPatch(feature))
        m.add_patches(_random_patch(model, seed, spread), 1.0)
        _inject()
        return (m,)


NODE_CLASS_MAPPINGS = {"FooocusInpaintLikeApply": FooocusInpaintLikeApply}
