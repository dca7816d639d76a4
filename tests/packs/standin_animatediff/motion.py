"""The motion model of the AnimateDiff stand-in: temporal modules injected into the UNet's blocks, and the
sliding context windows. What AnimateDiff-Evolved does, in miniature (docs/other_packs.md; read in
animatediff/motion_module_ad.py, model_injection.py, sampling.py and context.py).
"""
import math

import torch
from torch import nn

import comfy.ops
from comfy.ldm.modules.attention import SpatialTransformer, optimized_attention

PE_MAX_LEN = 32   # AnimateDiff's positional encoding covers 24 or 32 frames


class TemporalModuleLike(nn.Module):
    """AnimateDiff's VanillaTemporalModule: attention across the frames of each pixel, added to its input.
    Which frames it sees is Python state on the module (`video_length`, `sub_idxs`), set from outside
    before every call of a context window; the positional encoding is indexed with `sub_idxs`."""

    def __init__(self, channels, heads, generator):
        super().__init__()
        ops = comfy.ops.disable_weight_init
        self.heads = heads
        self.norm = ops.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)
        self.proj_in = ops.Linear(channels, channels)
        self.to_q = ops.Linear(channels, channels, bias=False)
        self.to_k = ops.Linear(channels, channels, bias=False)
        self.to_v = ops.Linear(channels, channels, bias=False)
        self.to_out = ops.Linear(channels, channels)
        self.proj_out = ops.Linear(channels, channels)
        self.register_buffer("pe", _sinusoidal(PE_MAX_LEN, channels), persistent=False)
        self.video_length, self.full_length, self.sub_idxs = 16, 16, None
        _seed_weights(self, generator)

    def set_video_length(self, video_length, full_length):
        self.video_length, self.full_length = video_length, full_length

    def set_sub_idxs(self, sub_idxs):
        self.sub_idxs = sub_idxs

    def forward(self, x, context=None, transformer_options=None):
        bf, c, h, w = x.shape
        f = self.video_length
        b = bf // f
        hs = self.norm(x).reshape(b, f, c, h * w).permute(0, 3, 1, 2).reshape(b * h * w, f, c)
        hs = self.proj_in(hs)
        pe = self.pe[self.sub_idxs] if self.sub_idxs is not None else self.pe[:f]
        q, k, v = self.to_q(hs + pe.to(hs)), self.to_k(hs + pe.to(hs)), self.to_v(hs)
        hs = hs + self.to_out(optimized_attention(q, k, v, self.heads))
        hs = self.proj_out(hs).reshape(b, h * w, f, c).permute(0, 2, 3, 1).reshape(bf, c, h, w)
        return x + hs


def _sinusoidal(length, channels):
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, channels, 2, dtype=torch.float32) * (-math.log(10000.0) / channels))
    pe = torch.zeros(length, channels)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


def _seed_weights(module, generator):
    """Trained motion modules are far from their zero-initialised proj_out; random weights of a modest
    scale give a visible, stable temporal effect."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("norm."):
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3 / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.01)


class MotionModelLike(nn.Module):
    """AnimateDiff's AnimateDiffModel: `down_blocks` / `up_blocks` of temporal modules, one per UNet block
    AnimateDiff's injection rule would place one in, in that order; built for the UNet it is applied to
    (AnimateDiff loads a checkpoint made for SD1.5 or SDXL)."""

    def __init__(self, diffusion_model, seed, heads=8):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        down, up = _targets(diffusion_model.input_blocks), _targets(diffusion_model.output_blocks)
        self.down_blocks = nn.ModuleList(TemporalModuleLike(c, heads, g) for c in down)
        self.up_blocks = nn.ModuleList(TemporalModuleLike(c, heads, g) for c in up)

    def modules_in_order(self):
        return list(self.down_blocks) + list(self.up_blocks)

    def set_video_length(self, video_length, full_length):
        for m in self.modules_in_order():
            m.set_video_length(video_length, full_length)

    def set_sub_idxs(self, sub_idxs):
        for m in self.modules_in_order():
            m.set_sub_idxs(sub_idxs)

    def inject(self, diffusion_model):
        _inject(diffusion_model.input_blocks, list(self.down_blocks))
        _inject(diffusion_model.output_blocks, list(self.up_blocks))

    def eject(self, diffusion_model):
        for blocks in (diffusion_model.input_blocks, diffusion_model.output_blocks):
            _eject(blocks)


def _placement(block):
    """AnimateDiff's rule, with its exact type tests: after the last SpatialTransformer of a block, else after
    its first ResBlock, else nowhere. Returns the index to insert at, or None."""
    st_idx = res_idx = -1
    for idx, component in enumerate(block):
        if type(component) == SpatialTransformer:
            st_idx = idx
        elif type(component).__name__ == "ResBlock" and res_idx < 0:
            res_idx = idx
    if st_idx >= 0:
        return st_idx + 1
    return res_idx + 1 if res_idx >= 0 else None


def _targets(blocks):
    """The channel count of every block with a ResBlock, in order: AnimateDiff's checkpoints hold one temporal
    module per such block of the UNet they were trained for. Read by duck type: the live blocks may hold
    another pack's stand-ins right now, and a checkpoint does not depend on them."""
    out = []
    for block in blocks:
        res = [m for m in block if hasattr(m, "emb_layers") and hasattr(m, "out_channels")]
        if res:
            out.append(res[0].out_channels)
    return out


def _inject(unet_blocks, modules):
    """AnimateDiff's _inject: walks the blocks until every module is placed, inserting in place into the
    block's nn.Sequential (it runs past the list, and fails, if fewer blocks qualify than it has modules)."""
    unet_idx = 0
    for module in modules:
        while True:
            at = _placement(unet_blocks[unet_idx])
            unet_idx += 1
            if at is not None:
                unet_blocks[unet_idx - 1].insert(at, module)
                break


def _eject(unet_blocks):
    for block in unet_blocks:
        for idx in sorted((i for i, m in enumerate(block) if type(m) == TemporalModuleLike), reverse=True):
            block.pop(idx)


# -- context windows (AnimateDiff's context.py) ------------------------------------------------------------
def context_windows(num_frames, length, overlap, schedule, step):
    """The frame windows of one step: "standard_static" (the same every step) or "standard_uniform"
    (AnimateDiff's default: shifted by the step through ordered halving, rolled-over windows moved back)."""
    if num_frames <= length:
        return [list(range(num_frames))]
    if schedule == "standard_static":
        return _static_windows(num_frames, length, overlap)
    return _uniform_windows(num_frames, length, overlap, step)


def _static_windows(num_frames, length, overlap):
    windows = []
    for start in range(0, num_frames, length - overlap):
        if start + length >= num_frames:
            windows.append(list(range(num_frames - length, num_frames)))
            break
        windows.append(list(range(start, start + length)))
    return windows


def _ordered_halving(val):
    return int(f"{val:064b}"[::-1], 2) / (1 << 64)


def _uniform_windows(num_frames, length, overlap, step):
    """Windows shifted by the step; a window that rolls over the end is moved back to end at the last frame,
    and where the next window then lacks the frame it rolled over to, one starting there is added (as
    AnimateDiff does: every frame is in some window, or its fused output would be 0 / 0)."""
    pad = int(round(num_frames * _ordered_halving(step)))
    windows = [[e % num_frames for e in range(j, j + length)]
               for j in range(int(_ordered_halving(step)) + pad, num_frames + pad - overlap, length - overlap)]
    i = 0
    while i < len(windows):
        w = windows[i]
        roll = next((k for k in range(1, len(w)) if w[k] < w[k - 1]), None)
        if roll is not None:
            first = w[roll]
            windows[i] = list(range(num_frames - length, num_frames))
            if first not in windows[(i + 1) % len(windows)]:
                windows.insert(i + 1, list(range(first, first + length)))
        i += 1
    out = []
    for w in windows:
        if w not in out:
            out.append(w)
    return out


def context_weights(length, fuse_method):
    if fuse_method == "flat":
        return [1.0] * length
    half = length // 2
    if length % 2 == 0:
        return list(range(1, half + 1)) + list(range(half, 0, -1))
    return list(range(1, half + 1)) + [half + 1] + list(range(half, 0, -1))


def resized_conds(conds, x_in, idxs):
    """AnimateDiff's get_resized_cond: every per-frame tensor of a cond (batch == the latent batch) cut to
    the window's frames; the rest as it is."""
    out = []
    for cond in conds:
        if cond is None:
            out.append(None)
            continue
        items = []
        for c in cond:
            c = dict(c)
            for key, v in list(c.items()):
                if isinstance(v, torch.Tensor) and v.size(0) == x_in.size(0):
                    c[key] = v[idxs]
                elif key == "model_conds":
                    c[key] = {k: _cut(mc, x_in, idxs) for k, mc in v.items()}
            items.append(c)
        out.append(items)
    return out


def _cut(mc, x_in, idxs):
    cond = getattr(mc, "cond", None)
    if isinstance(cond, torch.Tensor) and cond.size(0) == x_in.size(0):
        return mc._copy_with(cond[idxs])
    return mc


def run_windows(call, conds, x_in, timestep, state, transformer_options):
    """AnimateDiff's sliding_calc_cond_batch around `call(sub_conds, sub_x, sub_t)` (the host's own batch call):
    per window, the motion modules' frame state and `ad_params` (in place) are set, then the outputs are added
    up with the fuse weights and divided by the summed weights."""
    windows = context_windows(state.full_length, state.context_length, state.context_overlap,
                              state.context_schedule, state.current_step)
    final = [torch.zeros_like(x_in) for _ in conds]
    counts = [torch.zeros((x_in.shape[0], 1, 1, 1), device=x_in.device) for _ in conds]
    for idxs in windows:
        state.motion.set_sub_idxs(idxs)
        state.motion.set_video_length(len(idxs), state.full_length)
        transformer_options["ad_params"]["sub_idxs"] = idxs
        transformer_options["ad_params"]["context_length"] = len(idxs)
        outs = call(resized_conds(conds, x_in, idxs), x_in[idxs], timestep[idxs])
        w = torch.Tensor(context_weights(len(idxs), state.fuse_method)).to(x_in.device)[:, None, None, None]
        for i, out in enumerate(outs):
            if conds[i] is not None:
                final[i][idxs] += out * w
                counts[i][idxs] += w
    return [f / c if conds[i] is not None else f for i, (f, c) in enumerate(zip(final, counts))]


class SamplingState:
    """AnimateDiff's per-run global state (ADGS): the run's frame count, context options and step."""

    def __init__(self, motion, params, full_length):
        self.motion = motion
        self.full_length = full_length
        self.context_length = params["context_length"] or None
        self.context_overlap = params["context_overlap"]
        self.context_schedule = params["context_schedule"]
        self.fuse_method = params["fuse_method"]
        self.current_step = 0

    def using_context(self):
        return self.context_length is not None and self.full_length > self.context_length

    def exposed_params(self):
        return {"full_length": self.full_length, "context_length": self.context_length, "sub_idxs": None}

    def start(self):
        length = self.context_length if self.using_context() else self.full_length
        self.motion.set_video_length(length, self.full_length)
        self.motion.set_sub_idxs(None)

    def frames_per_norm(self):
        return self.context_length if self.using_context() else self.full_length


# -- the v1 GroupNorm across frames ----------------------------------------------------------------------
class groupnorm_swapped:  # noqa: N801 - used as a context manager, as AnimateDiff's helper is
    """AnimateDiff v1 models expect each GroupNorm to normalise across all frames of a video: while this is
    entered, the GroupNorm classes' forward (torch's, and ComfyUI's cast-weights one of `ops_class`) do that."""
    def __init__(self, state, ops_class=None):
        self.state = state
        self.ops_class = ops_class or comfy.ops.disable_weight_init.GroupNorm

    def __enter__(self):
        self.saved = torch.nn.GroupNorm.forward, self.ops_class.forward_comfy_cast_weights
        torch.nn.GroupNorm.forward = groupnorm_across_frames(self.state, cast=False)
        self.ops_class.forward_comfy_cast_weights = groupnorm_across_frames(self.state, cast=True)

    def __exit__(self, *exc):
        torch.nn.GroupNorm.forward, self.ops_class.forward_comfy_cast_weights = self.saved


def groupnorm_across_frames(state, cast):
    def forward(self, input):
        b = input.size(0) // state.frames_per_norm()
        x = input.reshape(b, -1, *input.shape[1:]).transpose(1, 2)        # (b f) c h w -> b c f h w
        w, bias = (comfy.ops.cast_bias_weight(self, input)[:2] if cast else (self.weight, self.bias))
        x = torch.nn.functional.group_norm(x, self.num_groups, w, bias, self.eps)
        return x.transpose(1, 2).reshape(input.shape)
    return forward
