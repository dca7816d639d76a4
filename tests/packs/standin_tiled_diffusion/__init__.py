"""Test stand-in for shiimizu/ComfyUI-TiledDiffusion's MultiDiffusion and Mixture of Diffusers (tiled_diffusion.py:
TiledDiffusion.apply, AbstractDiffusion.prepare_call, split_bboxes, MultiDiffusion/MixtureOfDiffusers.__call__): a
callable object set with `set_model_unet_function_wrapper` (the wrapper found there kept for steps outside its
sigma range) and `model_options["tiled_diffusion"] = True`. Per call it reads the sigma on the host, (re)builds
the overlapping tile grid when the latent's shape changed (Python state on the object), and calls the model function
once per batch of tiles: the tiles of the latent concatenated, the timestep and every conditioning tensor repeated to
that batch (a 4-d one, c_concat, cut into the same tiles), the outputs added into a buffer it keeps, then averaged by
how often each pixel was painted (MultiDiffusion) or weighted by a Gaussian per tile (Mixture of Diffusers). The node's
IS_CHANGED advances a module-global run number, which resets the object's state. Not reproduced: SpotDiffusion, its
rewrite of comfy.samplers.calc_cond_batch for tiled ControlNet hints, the SAG/GLIGEN hooks, region prompts.
docs/other_packs.md. Used only by the tests.
"""
import math

import torch

RUN_ID = [0]


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
        if self.buffer is None or self.buffer.shape != x.shape:
            self.buffer = torch.zeros_like(x)
        else:
            self.buffer.zero_()
        n = x.shape[0]
        for boxes in self.batches:
            x_tile = torch.cat([x[..., by:by + bh, bx:bx + bw] for bx, by, bw, bh in boxes], dim=0)
            c_tile = {}
            for k, v in c.items():
                if isinstance(v, torch.Tensor):
                    if v.ndim == x_tile.ndim:
                        v = torch.cat([v[..., by:by + bh, bx:bx + bw] for bx, by, bw, bh in boxes], dim=0)
                    if v.shape[0] != x_tile.shape[0]:
                        v = repeat_to_batch(v, x_tile.shape[0])
                c_tile[k] = v
            out = model_function(x_tile, repeat_to_batch(t, x_tile.shape[0]), **c_tile)
            for i, (bx, by, bw, bh) in enumerate(boxes):
                part = out[i * n:(i + 1) * n]
                if self.method == "Mixture of Diffusers":
                    part = part * (gaussian(bw, bh, x.device) / self.weights[..., by:by + bh, bx:bx + bw])
                self.buffer[..., by:by + bh, bx:bx + bw] += part
        if self.method == "Mixture of Diffusers":
            return self.buffer
        return torch.where(self.weights > 1, self.buffer / self.weights, self.buffer)


class TiledDiffusionLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "method": (["MultiDiffusion", "Mixture of Diffusers"], {"default": "Mixture of Diffusers"}),
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
