"""Test stand-in for cubiq/ComfyUI_IPAdapter_plus: patches a MODEL the way IPAdapter does, with random
projection weights and random "image embeds" instead of a CLIP vision model and an IPAdapter checkpoint.

Mechanism reproduced (docs/other_packs.md; read in IPAdapterPlus.py and CrossAttentionPatch.py):
  * the node clones the model, copies `model_options["transformer_options"]`, its "patches_replace" and its
    "attn2" dict, and puts one callable object per cross-attention block under ComfyUI's SD1.5 keys
    (("input", id), ("output", id), ("middle", 1)); a second IPAdapter on the same chain finds the object
    and `.add()`s itself to it in place (its clone's: ModelPatcher.clone deep-copies model_options, patch
    objects and their tensors included);
  * on every attn2 call the object runs ComfyUI's optimized_attention, reads the current sigma with
    `extra_options["sigmas"].detach().cpu()[0].item()` (a host sync), and adds each adapter whose
    [sigma_end, sigma_start] range holds that sigma (Python branching on a tensor value);
  * each adapter projects its cond/uncond embeds through its own Linear layers (weights outside the UNet),
    concatenates them in `cond_or_uncond` order and attends to them.
Used only by the tests; never loaded by the pack itself.
"""
import torch

import comfy.model_management as model_management
from comfy.ldm.modules.attention import optimized_attention

EMBED_DIM = 768   # CLIP-L width: SD1.5's cross-attention context, what IPAdapter's image projection yields


class AttnReplaceLike:
    """One attn2 replace patch holding every adapter stacked on this block (IPAdapter's Attn2Replace)."""

    def __init__(self, callback=None, **kwargs):
        self.callback = [callback]
        self.kwargs = [kwargs]

    def add(self, callback, **kwargs):
        self.callback.append(callback)
        self.kwargs.append(kwargs)

    def __call__(self, q, k, v, extra_options):
        dtype = q.dtype
        out = optimized_attention(q, k, v, extra_options["n_heads"])
        # IPAdapter reads sigma on the host on every call, and decides in Python which adapters act
        sigma = extra_options["sigmas"].detach().cpu()[0].item() if "sigmas" in extra_options else 999999999.9
        for callback, kw in zip(self.callback, self.kwargs):
            if kw["sigma_end"] <= sigma <= kw["sigma_start"]:
                out = out + callback(out, q, k, v, extra_options, **kw)
        return out.to(dtype=dtype)

    def to(self, device, *args, **kwargs):
        # ComfyUI calls .to() on every patch when it loads the model; IPAdapter's keeps its tensors where
        # they are (it built them on the load device) and returns itself
        return self


def adapter_attention(out, q, k, v, extra_options, module_key="", layers=None, weight=1.0, cond=None,
                      uncond=None, **kwargs):
    """What one adapter adds to a block's cross-attention output (IPAdapter's ipadapter_attention, linear
    weight type, 'V only' scaling, no mask)."""
    cond_or_uncond = extra_options["cond_or_uncond"]
    batch_prompt = q.shape[0] // len(cond_or_uncond)
    to_k, to_v = layers.to_kvs[module_key + "_to_k_ip"], layers.to_kvs[module_key + "_to_v_ip"]
    k_cond, k_uncond = to_k(cond).repeat(batch_prompt, 1, 1), to_k(uncond).repeat(batch_prompt, 1, 1)
    v_cond, v_uncond = to_v(cond).repeat(batch_prompt, 1, 1), to_v(uncond).repeat(batch_prompt, 1, 1)
    ip_k = torch.cat([(k_cond, k_uncond)[i] for i in cond_or_uncond], dim=0)
    ip_v = torch.cat([(v_cond, v_uncond)[i] for i in cond_or_uncond], dim=0)
    return (optimized_attention(q, ip_k, ip_v, extra_options["n_heads"]) * weight).to(dtype=q.dtype)


class ProjectionLayers(torch.nn.Module):
    """The adapter's own k/v projections per cross-attention block (IPAdapter's To_KV), seeded."""

    def __init__(self, inner_dims, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.to_kvs = torch.nn.ModuleDict()
        for n, dim in enumerate(inner_dims):
            for kind in ("k", "v"):
                lin = torch.nn.Linear(EMBED_DIM, dim, bias=False)
                with torch.no_grad():
                    lin.weight.copy_(torch.randn(dim, EMBED_DIM, generator=g) / EMBED_DIM ** 0.5)
                self.to_kvs["%d_to_%s_ip" % (2 * n + 1, kind)] = lin


def cross_attention_blocks(diffusion_model):
    """(key, inner dim) of every block with a cross-attention, in IPAdapter's order (input, output,
    middle). IPAdapter hard-codes SD1.5's ids; the test fixtures are smaller UNets, so they are read here."""
    out = []
    for name in ("input_blocks", "output_blocks"):
        for i, block in enumerate(getattr(diffusion_model, name)):
            dim = _attn2_dim(block)
            if dim is not None:
                out.append(((name.split("_")[0], i), dim))
    mid = _attn2_dim(diffusion_model.middle_block)
    if mid is not None:
        # IPAdapter keys the SD1.5 middle block ("middle", 1) (since 2024-09); ComfyUI calls it
        # ("middle", 0), so that entry is never called: kept, as the real pack leaves it there
        out.append((("middle", 1), mid))
    return out


def _attn2_dim(module):
    for m in module.modules():
        attn2 = getattr(m, "attn2", None)
        if attn2 is not None and hasattr(attn2, "to_k"):
            return attn2.to_k.out_features
    return None


def set_model_patch_replace(model, patch_kwargs, key):
    """IPAdapter's own registration: copies of the option dicts, a new object per block or `.add()` to the
    one already there."""
    to = model.model_options["transformer_options"].copy()
    to["patches_replace"] = dict(to.get("patches_replace", {}))
    to["patches_replace"]["attn2"] = dict(to["patches_replace"].get("attn2", {}))
    if key not in to["patches_replace"]["attn2"]:
        to["patches_replace"]["attn2"][key] = AttnReplaceLike(adapter_attention, **patch_kwargs)
        model.model_options["transformer_options"] = to
    else:
        to["patches_replace"]["attn2"][key].add(adapter_attention, **patch_kwargs)


def _model_sampling(model):
    """IPAdapter since 2024-04 asks the patcher (object patches included); its 2024-03 rewrite read the
    model's attribute, which is all the 2024 ComfyUI has."""
    if hasattr(model, "get_model_object"):
        return model.get_model_object("model_sampling")
    return model.model.model_sampling


class IPAdapterLikeApply:
    DESCRIPTION = "Test stand-in: patches the model's cross-attention the way IPAdapter does."
    CATEGORY = "sdaccel_tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "weight": ("FLOAT", {"default": 1.0, "min": -1.0, "max": 5.0, "step": 0.05}),
            "start_at": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "end_at": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
            "tokens": ("INT", {"default": 4, "min": 1, "max": 64}),
        }}

    def apply(self, model, weight, start_at, end_at, seed, tokens):
        device = model_management.get_torch_device()
        dtype = model_management.unet_dtype()
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.float16 if model_management.should_use_fp16() else torch.float32
        model = model.clone()
        blocks = cross_attention_blocks(model.model.diffusion_model)
        layers = ProjectionLayers([dim for _, dim in blocks], seed).to(device, dtype=dtype)
        g = torch.Generator().manual_seed(seed + 1)
        cond = torch.randn(1, tokens, EMBED_DIM, generator=g).to(device, dtype=dtype)
        uncond = (torch.randn(1, tokens, EMBED_DIM, generator=g) * 0.1).to(device, dtype=dtype)
        sampling = _model_sampling(model)
        kwargs = {"layers": layers, "weight": weight, "cond": cond, "uncond": uncond,
                  "sigma_start": sampling.percent_to_sigma(start_at), "sigma_end": sampling.percent_to_sigma(end_at)}
        for n, (key, _) in enumerate(blocks):
            set_model_patch_replace(model, dict(kwargs, module_key=str(2 * n + 1)), key)
        return (model,)


NODE_CLASS_MAPPINGS = {"IPAdapterLikeApply": IPAdapterLikeApply}
NODE_DISPLAY_NAME_MAPPINGS = {"IPAdapterLikeApply": "IPAdapter-like Apply (test stand-in)"}
