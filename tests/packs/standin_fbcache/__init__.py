"""Test stand-in for chengzeyi/Comfy-WaveSpeed's First Block Cache on an SD1.5/SDXL UNet (fbcache_nodes.py
ApplyFBCacheOnModel, first_block_cache.py create_patch_unet_model__forward): a `set_model_unet_function_wrapper`
that, around every call of the model function, sets the diffusion model's `_forward` as an instance attribute
(`unittest.mock.patch.object`) to its own forward. That forward runs the first two input blocks, reads on the host
whether the residual of input block 1 moved (relative mean abs difference against the one kept, `.item()`) by less
than `residual_diff_threshold`, and then either adds the residual of the rest of the UNet kept from the last full
call, or runs the rest and keeps its residual. What it keeps lives in a module-global cache context, one entry per
call at the same timestep (cond and uncond in separate calls), reset when the timestep rises or the latent's shape
changes, and cleared after each node's output (`execution.get_output_data` wrapped at apply). The wrapper reads the
timestep with `.item()`; start/end and the consecutive-hit limit are decided in its closure. Needs UNetModel's
`_forward` (ComfyUI late 2024 and later). docs/other_packs.md. Used only by the tests.
"""
import unittest.mock

import torch

from comfy.ldm.modules.diffusionmodules.openaimodel import apply_control, forward_timestep_embed
from comfy.ldm.modules.diffusionmodules.util import timestep_embedding


class _Context:
    """The kept tensors, per name a list indexed by the call's number at this timestep."""

    def __init__(self):
        self.buffers, self.sequence_num, self.use_cache = {}, 0, False

    def get(self, name):
        kept = self.buffers.get(name)
        return kept[self.sequence_num] if kept is not None and self.sequence_num < len(kept) else None

    def set(self, name, t):
        kept = self.buffers.setdefault(name, [])
        kept += [None] * (self.sequence_num + 1 - len(kept))
        kept[self.sequence_num] = t


CONTEXT = [None]    # the pack's module global: the current cache context


def _clear_after_outputs():
    """The pack wraps the executor's get_output_data once, dropping the context after each node's output."""
    import execution
    original = getattr(execution, "get_output_data", None)
    if original is None or getattr(original, "_fbcache_like", False):
        return

    def get_output_data(*args, **kwargs):
        out = original(*args, **kwargs)
        CONTEXT[0] = None
        return out
    get_output_data._fbcache_like = True
    execution.get_output_data = get_output_data


def _patched(to, name, *values):
    for p in to.get("patches", {}).get(name, []):
        values = p(*values, to)
        if not isinstance(values, tuple):
            values = (values,)
    return values


def _similar(kept, now, threshold):
    if kept.shape != now.shape:
        return False
    return ((kept - now).abs().mean() / kept.abs().mean()).item() < threshold


def _forward_for(unet, threshold, validate):
    """The pack's replacement of UNetModel._forward, bound to `unet`."""

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        to = transformer_options
        to["original_shape"] = list(x.shape)
        to["transformer_index"] = 0
        extra = {k: kwargs.get(k) for k in ("time_context", "num_video_frames", "image_only_indicator")}
        extra["num_video_frames"] = extra["num_video_frames"] or self.default_num_video_frames
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, repeat_only=False).to(x.dtype))
        for p in to.get("patches", {}).get("emb_patch", []):
            emb = p(emb, self.model_channels, to)
        if self.num_classes is not None:
            emb = emb + self.label_emb(y)
        ctx = CONTEXT[0]
        hs, h, cached = [], x, False
        for i, block in enumerate(self.input_blocks[:2]):
            to["block"] = ("input", i)
            before = h
            h = forward_timestep_embed(block, h, emb, context, to, **extra)
            h = apply_control(h, control, "input")
            (h,) = _patched(to, "input_block_patch", h)
            hs.append(h)
            (h,) = _patched(to, "input_block_patch_after_skip", h)
            if i == 1:
                first = h - before
                kept = ctx.get("first")
                cached = kept is not None and _similar(kept, first, threshold)
                if ctx.sequence_num > 0:
                    ctx.use_cache = ctx.use_cache and cached
                else:
                    ctx.use_cache = validate(cached) if validate is not None else cached
                cached = ctx.use_cache
                if not cached:
                    ctx.set("first", first)
        if cached:
            h = (ctx.get("rest") + h).contiguous()
        else:
            start = h
            for i, block in enumerate(self.input_blocks):
                if i < 2:
                    continue
                to["block"] = ("input", i)
                h = forward_timestep_embed(block, h, emb, context, to, **extra)
                h = apply_control(h, control, "input")
                (h,) = _patched(to, "input_block_patch", h)
                hs.append(h)
                (h,) = _patched(to, "input_block_patch_after_skip", h)
            to["block"] = ("middle", 0)
            if self.middle_block is not None:
                h = forward_timestep_embed(self.middle_block, h, emb, context, to, **extra)
            h = apply_control(h, control, "middle")
            for i, block in enumerate(self.output_blocks):
                to["block"] = ("output", i)
                hsp = apply_control(hs.pop(), control, "output")
                h, hsp = _patched(to, "output_block_patch", h, hsp)
                h = torch.cat([h, hsp], dim=1)
                h = forward_timestep_embed(block, h, emb, context, to, hs[-1].shape if hs else None, **extra)
            ctx.set("rest", h - start)
        return self.out(h.type(x.dtype))
    return forward.__get__(unet)


class FBCacheLikeApply:
    CATEGORY = "tests/stand-ins"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "residual_diff_threshold": ("FLOAT", {"default": 0.12, "min": 0.0, "max": 1.0,
                                                                   "step": 0.001}),
                             "start": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01}),
                             "end": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
                             "max_consecutive_cache_hits": ("INT", {"default": -1, "min": -1})}}

    def apply(self, model, residual_diff_threshold, start=0.0, end=1.0, max_consecutive_cache_hits=-1):
        if residual_diff_threshold <= 0.0 or max_consecutive_cache_hits == 0:
            return (model,)
        _clear_after_outputs()
        state = {"t": None, "shape": None, "now": None, "hits": 0}
        validate = None
        if max_consecutive_cache_hits >= 0 or start > 0 or end < 1:
            sampling = model.get_model_object("model_sampling")
            start_sigma, end_sigma = (float(sampling.percent_to_sigma(p)) for p in (start, end))

            def validate(cached):
                cached = cached and end_sigma <= state["now"] <= start_sigma
                cached = cached and (max_consecutive_cache_hits < 0 or state["hits"] < max_consecutive_cache_hits)
                state["hits"] = state["hits"] + 1 if cached else 0
                return cached

        def reset():
            state.update(t=None, shape=None, hits=0)
            CONTEXT[0] = _Context()

        model = model.clone()
        unet = model.get_model_object("diffusion_model")
        forward = _forward_for(unet, residual_diff_threshold, validate)

        def unet_function(model_function, params):
            try:
                x, timestep, c = params["input"], params["timestep"], params["c"]
                t = timestep[0].item()
                shape = (tuple(x.shape[1:]), x.dtype, x.device)
                if state["t"] is None or state["shape"] != shape or CONTEXT[0] is None or t > state["t"]:
                    reset()
                elif t == state["t"]:
                    CONTEXT[0].sequence_num += 1     # cond and uncond in separate calls of one step
                else:
                    CONTEXT[0].sequence_num = 0
                state["now"] = t
                with unittest.mock.patch.object(unet, "_forward", forward):
                    out = model_function(x, timestep, **c)
                state["t"], state["shape"] = t, shape
                return out
            except Exception:
                reset()
                raise

        model.set_model_unet_function_wrapper(unet_function)
        return (model,)


NODE_CLASS_MAPPINGS = {"FBCacheLikeApply": FBCacheLikeApply}
