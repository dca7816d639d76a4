"""A plain-torch reference of DeepCache (Ma et al. 2023) on ComfyUI's ldm UNetModel, for the step-cache tests.

`unet_call(unet, x, timesteps, context, y, control, feature, branch)` -> (output, deep feature). Without a
feature it runs every block and returns the feature entering output block L-1-branch; with one it runs
input blocks 0..branch, then output blocks L-1-branch..L-1 on that feature. It walks each block's layers
itself and takes ControlNet residuals by index, as the rule reads: input block i takes entry len-1-i of
"input", the middle block the last of "middle", the skip into output block j entry len-1-j of "output"; a
block that does not run takes none. Of the patches, only output_block_patch functions (FreeU's), called at
each output block that runs, with the feature kept before them.

`ReferenceDeepCache(patcher, mode, branch)`: a model_function_wrapper for ComfyUI's stock sampler (one per
sampling run) that computes each call's denoised output with `unet_call`: the call's step is its sigma's
place in the run's sigmas (a call at sigmas[i] is step i), the full steps are the paper's schedule, and one
feature is kept per batch shape and cond pattern.
"""
import math

import torch


def _layers(block, h, emb, context, output_shape=None):
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import TimestepBlock, Upsample
    for layer in block:
        if isinstance(layer, TimestepBlock):
            h = layer(h, emb)
        elif isinstance(layer, SpatialTransformer):
            h = layer(h, context=context, transformer_options={})
        elif isinstance(layer, Upsample):
            h = layer(h, output_shape=output_shape)
        else:
            h = layer(h)
    return h


def _residual(control, name, index):
    entries = (control or {}).get(name) or []
    k = len(entries) - 1 - index
    return entries[k] if 0 <= k < len(entries) else None


def _plus(h, r):
    return h if r is None else h + r


def unet_call(unet, x, timesteps, context, y=None, control=None, feature=None, branch=0, output_patches=()):
    from comfy.ldm.modules.diffusionmodules.util import timestep_embedding
    emb = unet.time_embed(timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype))
    if unet.num_classes is not None:
        emb = emb + unet.label_emb(y)
    n = len(unet.input_blocks)
    h, skips = x, []
    for i in range(n if feature is None else branch + 1):
        h = _plus(_layers(unet.input_blocks[i], h, emb, context), _residual(control, "input", i))
        skips.append(h)
    if feature is None:
        h = _plus(_layers(unet.middle_block, h, emb, context), _residual(control, "middle", 0))
        start = 0
    else:
        h, start = feature.clone(), n - 1 - branch    # a patch may scale h in place: the feature stays as kept
    kept = None
    for j in range(start, n):
        if j == n - 1 - branch and feature is None:
            kept = h.clone()
        i = n - 1 - j
        skip = _plus(skips[i], _residual(control, "output", j))
        for p in output_patches:
            h, skip = p(h, skip, {"block": ("output", j)})
        h = _layers(unet.output_blocks[j], torch.cat([h, skip], dim=1), emb, context,
                    skips[i - 1].shape if i > 0 else None)
    return unet.out(h.type(x.dtype)), kept


def full_steps(total, mode):
    """The paper's full steps, written out here: uniform 1:N, or non-uniform 1:N around a quarter of the run."""
    kind, n = mode.split(" ")
    n = int(n)
    if kind == "interval":
        return set(range(0, total, n))
    count, c, p = math.ceil(total / n), total * 0.25, 1.4
    while p > 1 and count > 1:
        a, b = -(c ** (1 / p)), (total - c) ** (1 / p)
        points = [a + (b - a) * k / count for k in range(count + 1)]
        vals = sorted({math.floor(c + math.copysign(abs(u) ** p, u) + 1e-9) for u in points})
        picked = {0} | {v for v in vals[1:-1] if 0 < v < total}
        if len(picked) == count:
            return picked
        p -= 0.02
    return {0} if count <= 1 else set(range(0, total, n))


class ReferenceDeepCache:
    def __init__(self, patcher, mode, branch=0):
        self.model = patcher.model
        self.mode, self.branch = mode, branch
        self.features, self.kinds = {}, []

    def __call__(self, apply_model, a):
        x, sigma, c = a["input"], a["timestep"], a["c"]
        to = c["transformer_options"]
        sigmas = to["sample_sigmas"]
        patches = to.get("patches") or {}
        assert set(patches) <= {"output_block_patch"}, "the reference runs output_block_patch functions only"
        step = int(torch.argmin((sigmas[:-1] - sigma[0]).abs()))
        slot = (tuple(x.shape), tuple(a["cond_or_uncond"]))
        full = step in full_steps(len(sigmas) - 1, self.mode) or slot not in self.features
        ms, unet = self.model.model_sampling, self.model.diffusion_model
        xc = ms.calculate_input(sigma, x).to(unet.dtype)
        y = c.get("y")
        out, feature = unet_call(unet, xc, ms.timestep(sigma).float(), c["c_crossattn"].to(unet.dtype),
                                 None if y is None else y.to(unet.dtype), c.get("control"),
                                 None if full else self.features[slot], self.branch,
                                 patches.get("output_block_patch") or ())
        if full:
            self.features[slot] = feature
        self.kinds.append(("full" if full else "cached", step))
        return ms.calculate_denoised(sigma, out.float(), x)
