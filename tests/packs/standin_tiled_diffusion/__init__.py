"""Test stand-in for shiimizu/ComfyUI-TiledDiffusion's MultiDiffusion and Mixture of Diffusers (tiled_diffusion.py:
TiledDiffusion.apply, AbstractDiffusion.prepare_call, split_bboxes, MultiDiffusion/MixtureOfDiffusers.__call__): a
callable object set with `set_model_unet_function_wrapper` (the wrapper found there kept for steps outside its
sigma range) and `model_options["tiled_diffusion"] = True`. Per call it reads the sigma on the host, (re)builds
the overlapping tile grid when the latent's shape changed (Python state on the object), and calls the model function
once per batch of tiles: the tiles of the latent concatenated, the timestep and every conditioning tensor repeated to
that batch (a 4-d one, c_concat, cut into the same tiles), the outputs added into a buffer it keeps, then averaged by
how often each pixel was painted (MultiDiffusion) or weighted by a Gaussian per tile (Mixture of Diffusers). The node's
IS_CHANGED advances a module-global run number, which resets the object's state. ControlNets: at import the pack wraps
comfy.samplers' batch call (to keep its model options) and `get_area_and_mult`, which, with `tiled_diffusion` in
those options, saves each ControlNet's `get_control` as the instance attribute `get_control_orig` and sets
`get_control` on the instance to return the ControlNet itself; the wrapper then sets each chain link's `cond_hint`
to the hint cut into the batch's tiles (cached per call shape and batch) and calls `get_control_orig` on the tiles.
Not reproduced: SpotDiffusion, the SAG/GLIGEN hooks, region prompts, T2I adapters and control-LoRAs' hints.
docs/other_packs.md. Used only by the tests.
"""
import inspect
import math

import torch

import comfy.samplers
import comfy.utils

RUN_ID = [0]
STORE = {"model_options": None}    # the pack's `store`: the options of the batch call under way


def ceildiv(big, small):
    return -(big // -small)


def repeat_to_batch(t, n):
    if t.shape[0] == 1:
        return t.expand([n] + [-1] * (t.ndim - 1))
    if t.shape[0] > n:
        return t.narrow(0, 0, n)
    if t.shape[0] < n:
        return t.repeat([ceildiv(n, t.shape[0])] + [1] * (t.ndim - 1)).narrow(0, 0, n)
    return t


def tile_grid(w, h, tile_w, tile_h, overlap):
    """Overlapping tiles covering w x h (latent pixels): [(x, y)] of their corners."""
    cols, rows = ceildiv(w - overlap, tile_w - overlap), ceildiv(h - overlap, tile_h - overlap)
    dx = (w - tile_w) / (cols - 1) if cols > 1 else 0
    dy = (h - tile_h) / (rows - 1) if rows > 1 else 0
    return [(min(int(c * dx), w - tile_w), min(int(r * dy), h - tile_h)) for r in range(rows) for c in range(cols)]


def gaussian(tile_w, tile_h, device):
    def f(x, mid, var=0.01):
        return math.exp(-(x - mid) * (x - mid) / (tile_w * tile_w) / (2 * var)) / math.sqrt(2 * math.pi * var)
    xs = torch.tensor([f(x, (tile_w - 1) / 2) for x in range(tile_w)])
    ys = torch.tensor([f(y, tile_h / 2) for y in range(tile_h)])
    return torch.outer(ys, xs).to(device, torch.float32)


def _wrap_samplers():
    """The pack's hooks on comfy.samplers, once: the batch call keeps its model options in STORE, and
    get_area_and_mult makes a ControlNet hand itself to the wrapper while tiled_diffusion is in them."""
    batch_name = "calc_cond_batch" if hasattr(comfy.samplers, "calc_cond_batch") else "calc_cond_uncond_batch"
    batch_call, area_and_mult = getattr(comfy.samplers, batch_name), comfy.samplers.get_area_and_mult
    if getattr(batch_call, "_tiled_like", False):
        return
    signature = inspect.signature(batch_call)

    def batch(*args, **kwargs):
        STORE["model_options"] = signature.bind(*args, **kwargs).arguments.get("model_options")
        return batch_call(*args, **kwargs)

    def get_area_and_mult(conds, *args, **kwargs):
        control = conds.get("control")
        if control is not None:
            if "tiled_diffusion" in (STORE["model_options"] or {}):
                if not hasattr(control, "get_control_orig"):
                    control.get_control_orig = control.get_control
                control.get_control = lambda *a, **kw: control
            elif hasattr(control, "get_control_orig") and control.get_control != control.get_control_orig:
                control.get_control = control.get_control_orig
        return area_and_mult(conds, *args, **kwargs)
    batch._tiled_like = True
    setattr(comfy.samplers, batch_name, batch)
    comfy.samplers.get_area_and_mult = get_area_and_mult


_wrap_samplers()


class TiledLike:
    def __init__(self, method, tile_width, tile_height, tile_overlap, tile_batch_size, old_wrapper):
        self.method, self.old_wrapper = method, old_wrapper
        self.tile_w, self.tile_h, self.overlap = tile_width // 8, tile_height // 8, tile_overlap // 8
        self.tile_batch_size = tile_batch_size
        self.start_sigma, self.end_sigma = float("inf"), 0.0    # TiledDiffusionParams' defaults
        self.reset()

    def reset(self):
        self.run_id = RUN_ID[0]
        self.shape, self.batches, self.weights, self.buffer = None, None, None, None
        self.hints = {}    # (cond_or_uncond, tile shape, link, batch) -> that batch's tiles of the link's hint

    def refresh(self, x):
        n, (h, w) = x.shape[0], x.shape[-2:]
        tw, th = min(self.tile_w, w), min(self.tile_h, h)
        overlap = max(0, min(self.overlap, min(tw, th) - 4))
        boxes = [(bx, by, tw, th) for bx, by in tile_grid(w, h, tw, th, overlap)]
        count = ceildiv(len(boxes), self.tile_batch_size)
        per = ceildiv(len(boxes), count)
        self.batches = [boxes[i * per:(i + 1) * per] for i in range(count)]
        self.weights = torch.zeros(1, 1, h, w, device=x.device)
        one = gaussian(tw, th, x.device) if self.method == "Mixture of Diffusers" else 1.0
        for bx, by, bw, bh in boxes:
            self.weights[..., by:by + bh, bx:bx + bw] += one
        self.shape = (n, h, w)

    @torch.inference_mode()
    def __call__(self, model_function, args):
        if self.run_id != RUN_ID[0]:
            self.reset()
        x, t, c = args["input"], args["timestep"], args["c"]
        sigma = t.detach().max().to(device="cpu", copy=True)     # the pack's host read
        if not self.end_sigma <= sigma <= self.start_sigma:
            return self.old_wrapper(model_function, args) if self.old_wrapper else model_function(x, t, **c)
        if self.shape != (x.shape[0],) + tuple(x.shape[-2:]):
            self.refresh(x)
            self.hints = {}
        if self.buffer is None or self.buffer.shape != x.shape:
            self.buffer = torch.zeros_like(x)
        else:
            self.buffer.zero_()
        n = x.shape[0]
        for batch_id, boxes in enumerate(self.batches):
            x_tile = torch.cat([x[..., by:by + bh, bx:bx + bw] for bx, by, bw, bh in boxes], dim=0)
            c_tile = {}
            for k, v in c.items():
                if isinstance(v, torch.Tensor):
                    if v.ndim == x_tile.ndim:
                        v = torch.cat([v[..., by:by + bh, bx:bx + bw] for bx, by, bw, bh in boxes], dim=0)
                    if v.shape[0] != x_tile.shape[0]:
                        v = repeat_to_batch(v, x_tile.shape[0])
                c_tile[k] = v
            t_tile = repeat_to_batch(t, x_tile.shape[0])
            if "control" in c:
                self.tile_hints(c["control"], x, x_tile, boxes, args["cond_or_uncond"], batch_id)
                control = c["control"]
                extra = (c["transformer_options"],) if _takes_options(control) else ()
                c_tile["control"] = control.get_control_orig(x_tile, t_tile, c_tile, len(args["cond_or_uncond"]),
                                                             *extra)
            out = model_function(x_tile, t_tile, **c_tile)
            for i, (bx, by, bw, bh) in enumerate(boxes):
                part = out[i * n:(i + 1) * n]
                if self.method == "Mixture of Diffusers":
                    part = part * (gaussian(bw, bh, x.device) / self.weights[..., by:by + bh, bx:bx + bw])
                self.buffer[..., by:by + bh, bx:bx + bw] += part
        if self.method == "Mixture of Diffusers":
            return self.buffer
        return torch.where(self.weights > 1, self.buffer / self.weights, self.buffer)


    def tile_hints(self, control, x, x_tile, boxes, cond_or_uncond, batch_id):
        """Each link's hint at the latent's size, cut into this batch's tiles: its `cond_hint` for the call."""
        link_id = 0
        while control is not None:
            key = (tuple(cond_or_uncond), tuple(x_tile.shape), link_id, batch_id)
            if key not in self.hints:
                ratio = getattr(control, "compression_ratio", 8)
                dtype = getattr(control, "manual_cast_dtype", None) or getattr(
                    getattr(control, "control_model", None), "dtype", None) or x.dtype
                device = getattr(control, "device", x.device)
                full = comfy.utils.common_upscale(control.cond_hint_original, x.shape[-1] * ratio, x.shape[-2] * ratio,
                                                  control.upscale_algorithm, "center").to(dtype=dtype, device=device)
                full = getattr(control, "preprocess_image", lambda a: a)(full)
                full = repeat_to_batch(full, x.shape[0])
                self.hints[key] = torch.cat([full[..., by * ratio:(by + bh) * ratio, bx * ratio:(bx + bw) * ratio]
                                             for bx, by, bw, bh in boxes], dim=0)
            control.cond_hint = self.hints[key]
            control = control.previous_controlnet
            link_id += 1


def _takes_options(control):
    """Current ComfyUI's get_control takes transformer_options, 2024's does not."""
    return "transformer_options" in inspect.signature(type(control).get_control).parameters


class TiledDiffusionLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "method": (["MultiDiffusion", "Mixture of Diffusers"],
                                        {"default": "Mixture of Diffusers"}),
                             "tile_width": ("INT", {"default": 768, "min": 16, "max": 8192, "step": 16}),
                             "tile_height": ("INT", {"default": 768, "min": 16, "max": 8192, "step": 16}),
                             "tile_overlap": ("INT", {"default": 64, "min": 0, "max": 2048, "step": 32}),
                             "tile_batch_size": ("INT", {"default": 4, "min": 1, "max": 8192})}}

    @classmethod
    def IS_CHANGED(cls, *args, **kwargs):
        RUN_ID[0] += 1
        return ""

    def apply(self, model, method, tile_width, tile_height, tile_overlap, tile_batch_size):
        model = model.clone()
        impl = TiledLike(method, tile_width, tile_height, tile_overlap, tile_batch_size,
                         model.model_options.get("model_function_wrapper"))
        model.set_model_unet_function_wrapper(impl)
        model.model_options["tiled_diffusion"] = True
        return (model,)


NODE_CLASS_MAPPINGS = {"TiledDiffusionLikeApply": TiledDiffusionLikeApply}
