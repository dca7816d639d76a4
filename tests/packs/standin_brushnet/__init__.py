"""Test stand-in for nullquant/ComfyUI-BrushNet's BrushNet node on an SD1.5/SDXL UNet (brushnet_nodes.py `BrushNet`,
`add_brushnet_patch`, `brushnet_inference`; model_patch.py `patch_model_function_wrapper`,
`apply_model_function_wrapper`, `brushNet_out_sample_wrapper`, `set_brushNet_hook`, `forward_patched_by_brushnet`,
`modified_apply_control`), as the current release hooks ComfyUI:
  * on the patcher, through `model.wrappers.update(...)`: an APPLY_MODEL and an OUTER_SAMPLE wrapper under the key
    None. `update` replaces the whole dict of each wrapper type, so wrappers set earlier under other keys go;
  * the OUTER_SAMPLE wrapper sets a `forward` on the instance of every layer of every UNet block (the layer's own
    forward saved as `original_forward`, an `add_sample_after` of 0), swaps `openaimodel.apply_control` for its
    own, and puts both back after the run; it stores the run's sigmas in `transformer_options`;
  * the APPLY_MODEL wrapper, before each call: `to["sigmas"][0].item()` (a host read) finds the step among the
    run's sigmas, the BrushNet network runs on the model's input beside the masked image's latent and the mask, and
    each of its samples is set as `add_sample_after` on the last layer of a block (and on its up/downsample): a
    tensor attribute that layer's patched forward adds to its output, then sets back to 0. Outside [start_at,
    end_at] (step numbers) the samples are scaled by 0. State in `transformer_options` changes per call (`step`,
    `total_steps`, `latent_id`).
The layers BrushNet targets are SD1.5's and SDXL's lists in the pack; here the same rule is read off whatever layout
the UNet has (a block's last layer, its up/downsample too), so the small test UNets get one sample per block.
Not reproduced: the BrushNet network itself (a UNet encoder and decoder of the base model's size); its samples here
are a fixed random 1x1 projection of the same inputs (the model input, the masked image's latent, the mask),
scaled by the timestep; the prompt embeddings it is also given; PowerPaint. docs/other_packs.md. Used only by the
tests.
"""
import types

import torch
import torch.nn.functional as F

import comfy.model_management
from comfy.ldm.modules.diffusionmodules import openaimodel

try:
    import comfy.patcher_extension as pe
except ImportError:     # ComfyUI 2024: the pack's current release needs ComfyUI's wrappers
    pe = None

SD15_SCALING_FACTOR = 0.18215


def add_model_patch_option(model):
    to = model.model_options.setdefault("transformer_options", {})
    to.setdefault("brush_model_patch", {})
    return to


# -- the layers a sample is added after, and their output shapes -------------------------------------------------
def _is_resample(layer):
    return isinstance(layer, (openaimodel.Downsample, openaimodel.Upsample))


def _channels(layer):
    for name in ("out_channels", "in_channels"):   # ResBlock/Conv2d/Up/Downsample; SpatialTransformer
        c = getattr(layer, name, None)
        if isinstance(c, int):
            return c
    raise TypeError("no channel count on %s" % type(layer).__name__)


def targets(unet, height, width):
    """[(blocks name, block index or None, layer index, (C, H, W))]: where each sample goes, in the network's
    output order (input blocks, the middle block, output blocks)."""
    sizes, level, out = [(height, width)], 0, []
    for i, block in enumerate(unet.input_blocks):
        j = len(block) - 1
        if isinstance(block[j], openaimodel.Downsample):
            sizes.append(((sizes[-1][0] + 1) // 2, (sizes[-1][1] + 1) // 2))
            level += 1
        out.append(("input_blocks", i, j, (_channels(block[j]),) + sizes[level]))
    mids = [j for j, layer in enumerate(unet.middle_block) if isinstance(layer, openaimodel.ResBlock)]
    out.append(("middle_block", None, mids[-1], (_channels(unet.middle_block[mids[-1]]),) + sizes[level]))
    for i, block in enumerate(unet.output_blocks):
        main = [j for j, layer in enumerate(block) if not _is_resample(layer)][-1]
        out.append(("output_blocks", i, main, (_channels(block[main]),) + sizes[level]))
        for j, layer in enumerate(block):
            if isinstance(layer, openaimodel.Upsample):
                level -= 1
                out.append(("output_blocks", i, j, (_channels(layer),) + sizes[level]))
    return out


def _layer(unet, where, i, j):
    blocks = getattr(unet, where)
    return blocks[j] if i is None else blocks[i][j]


class BrushNetLike(torch.nn.Module):
    """In place of the BrushNet network: per target a 1x1 projection of [model input (4), masked image latent (4),
    mask (1)], at the target's size, times a factor of the timestep."""

    def __init__(self, unet, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        layout = targets(unet, 64, 64)
        self.projections = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(c, 9, generator=g) * 0.5, requires_grad=False) for _, _, _, (c, _, _)
             in layout])

    def forward(self, x, brushnet_cond, timestep, conditioning_scale, sizes):
        inputs = torch.cat([x[:, :4], brushnet_cond], dim=1)
        scale = (1.0 + timestep / 1000.0).view(-1, 1, 1, 1) * conditioning_scale
        samples = []
        for w, (_, h, wd) in zip(self.projections, sizes):
            at = F.interpolate(inputs, size=(h, wd), mode="bilinear", align_corners=False)
            samples.append(torch.einsum("oc,bchw->bohw", w.to(at.dtype), at) * scale.to(at.dtype))
        return samples


# -- per call: the network's samples onto the layers -------------------------------------------------------------
def brushnet_inference(x, timesteps, transformer_options, unet):
    bmp = transformer_options["brush_model_patch"]
    bo = bmp["brushnet"]
    brushnet, torch_dtype = bo["model"], bo["dtype"]
    cl_list = bo["latents"]
    scale, start, end = bo["controls"]
    do_cfg = len(transformer_options["cond_or_uncond"]) > 1
    x = x.detach().clone().to(torch_dtype).to(bo["device"])
    timesteps = timesteps.detach().clone().to(torch_dtype).to(bo["device"])
    step = bmp["step"]
    batch, incoming, got = cl_list[0].shape[0], x.shape[0], bo["latent_id"]
    image_latents, masks, continue_batch, number = [], [], True, got
    for i in range(incoming):      # cond rows, then uncond rows, of the image batch (the pack's own walk)
        number = got + i
        if number < batch:
            k = number
        elif do_cfg and number < batch * 2:
            k = number - batch
        else:
            k, continue_batch = 0, False
        image_latents.append(cl_list[0][k][None])
        masks.append(cl_list[1][k][None])
    if continue_batch:
        last = batch * 2 - 1 if do_cfg else batch - 1
        bo["latent_id"] = number + 1 if number < last else 0
    else:
        bo["latent_id"] = 0
    cond = torch.cat([torch.cat([il, m], dim=1) for il, m in zip(image_latents, masks)], dim=0)
    cond = cond.to(torch_dtype).to(bo["device"])
    if x.shape[2:] != cond.shape[2:]:
        cond = F.interpolate(cond, size=x.shape[2:], mode="bicubic").to(torch_dtype)
    cond_scale = 0.0 if step < start or step > end else scale
    layout = targets(unet, x.shape[2], x.shape[3])
    samples = brushnet(x, cond, timesteps, cond_scale, [shape for *_, shape in layout])
    return layout, samples


def brushnet_forward(unet, x, timesteps, transformer_options, control):
    """The patch the pack keeps in `brush_model_patch["forward"]`: a sample onto each target layer."""
    if "brushnet" not in transformer_options["brush_model_patch"]:
        layout, samples = targets(unet, x.shape[2], x.shape[3]), []
    else:
        layout, samples = brushnet_inference(x, timesteps, transformer_options, unet)
    samples = list(samples)
    for where, i, j, _ in layout:
        _layer(unet, where, i, j).add_sample_after = samples.pop(0) if samples else 0


def apply_model_function_wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None,
                                 transformer_options={}, **kwargs):  # noqa: B006 - the pack's own signature
    base_model = executor.class_obj
    to = transformer_options
    if "brush_model_patch" not in to or "forward" not in to["brush_model_patch"]:
        return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
    bmp = to["brush_model_patch"]
    all_sigmas = bmp["all_sigmas"]
    sigma = to["sigmas"][0].item()
    bmp["total_steps"] = all_sigmas.shape[0] - 1
    bmp["step"] = torch.argmin((all_sigmas - sigma).abs()).item()
    xc = base_model.model_sampling.calculate_input(t, x)
    if c_concat is not None:
        xc = torch.cat([xc, c_concat], dim=1)
    brush_t = base_model.model_sampling.timestep(t).float()
    for method in bmp["forward"]:
        method(base_model.diffusion_model, xc, brush_t, to, control)
    return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)


# -- per run: every block's layers hooked, apply_control swapped --------------------------------------------------
def forward_patched_by_brushnet(self, x, *args, **kwargs):
    h = self.original_forward(x, *args, **kwargs)
    to_add = self.add_sample_after
    if torch.is_tensor(to_add):
        if h.shape[2:] != to_add.shape[2:]:
            to_add = F.interpolate(to_add, size=h.shape[2:], mode="bicubic")
        h += to_add.to(h.dtype).to(h.device)
    else:
        h += to_add
    self.add_sample_after = 0
    return h


def modified_apply_control(h, control, name):
    if control is not None and name in control and len(control[name]) > 0:
        ctrl = control[name].pop()
        if ctrl is not None:
            if h.shape[2:] != ctrl.shape[2:]:
                ctrl = F.interpolate(ctrl, size=h.shape[2:], mode="bicubic").to(h.dtype).to(h.device)
            h += ctrl
    return h


def _layers(unet):
    for block in list(unet.input_blocks) + [unet.middle_block] + list(unet.output_blocks):
        yield from block


def set_hook(unet):
    for layer in _layers(unet):
        if not hasattr(layer, "original_forward"):
            layer.original_forward = layer.forward
        layer.forward = types.MethodType(forward_patched_by_brushnet, layer)
        layer.add_sample_after = 0
    openaimodel.original_apply_control = openaimodel.apply_control
    openaimodel.apply_control = modified_apply_control


def clean_hook(unet):
    for layer in _layers(unet):
        if hasattr(layer, "original_forward"):
            layer.forward = layer.original_forward
            del layer.original_forward
            del layer.add_sample_after
    if hasattr(openaimodel, "original_apply_control"):
        openaimodel.apply_control = openaimodel.original_apply_control
        del openaimodel.original_apply_control


def out_sample_wrapper(executor, noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None,
                       disable_pbar=False, seed=None):
    guider = executor.class_obj
    unet = guider.model_patcher.model.diffusion_model
    set_hook(unet)
    add_model_patch_option(guider)["brush_model_patch"]["all_sigmas"] = sigmas
    try:
        return executor(noise, latent_image, sampler, sigmas, denoise_mask=denoise_mask, callback=callback,
                        disable_pbar=disable_pbar, seed=seed)
    finally:
        clean_hook(unet)


def patch_model_function_wrapper(model, forward_patch):
    patch_wrapper = {}
    pe.add_wrapper(pe.WrappersMP.APPLY_MODEL, apply_model_function_wrapper, patch_wrapper, is_model_options=False)
    bmp = add_model_patch_option(model)["brush_model_patch"]
    bmp.setdefault("forward", []).append(forward_patch)
    bmp["step"], bmp["total_steps"] = 0, 1
    pe.add_wrapper(pe.WrappersMP.OUTER_SAMPLE, out_sample_wrapper, patch_wrapper, is_model_options=False)
    model.wrappers.update(patch_wrapper["wrappers"])


# -- the node -----------------------------------------------------------------------------------------------------
class BrushNetLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL", "CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("model", "positive", "negative", "latent")
    FUNCTION = "model_update"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "vae": ("VAE",), "image": ("IMAGE",), "mask": ("MASK",),
                             "positive": ("CONDITIONING",), "negative": ("CONDITIONING",),
                             "scale": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0}),
                             "start_at": ("INT", {"default": 0, "min": 0, "max": 10000}),
                             "end_at": ("INT", {"default": 10000, "min": 0, "max": 10000}),
                             "dtype": (["float16", "float32"],), "seed": ("INT", {"default": 0, "min": 0})}}

    def model_update(self, model, vae, image, mask, positive, negative, scale, start_at, end_at, dtype="float16",
                     seed=0):
        if pe is None:
            raise RuntimeError("BrushNet needs ComfyUI's model wrappers (comfy.patcher_extension)")
        model = model.clone()
        torch_dtype = torch.float16 if dtype == "float16" else torch.float32
        device = comfy.model_management.get_torch_device()
        if mask.dim() == 2:
            mask = mask[None]
        mask = F.interpolate(mask[:, None], size=image.shape[1:3], mode="bilinear")[:, 0]
        masked = image * (1.0 - mask[:, :, :, None])
        scaling = getattr(model.model.model_config.latent_format, "scale_factor", SD15_SCALING_FACTOR)
        with torch.inference_mode():
            latents = vae.encode(masked[:, :, :, :3]) * scaling
        mask_latent = F.interpolate(1.0 - mask[:, None], size=latents.shape[-2:])
        unet = model.get_model_object("diffusion_model")
        brushnet = BrushNetLike(unet, seed).to(device=device, dtype=torch_dtype)
        patch_model_function_wrapper(model, brushnet_forward)
        bo = add_model_patch_option(model)["brush_model_patch"].setdefault("brushnet", {})
        bo.update(model=brushnet, dtype=torch_dtype, device=device, latent_id=0,
                  latents=[latents.to(device, torch_dtype), mask_latent.to(device, torch_dtype)],
                  controls=(scale, start_at, end_at))
        latent = torch.zeros([image.shape[0], 4, latents.shape[2], latents.shape[3]], device=device)
        return (model, positive, negative, {"samples": latent})


NODE_CLASS_MAPPINGS = {"BrushNetLikeApply": BrushNetLikeApply}
