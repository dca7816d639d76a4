"""Keep a channels_last UNet channels_last through its SpatialTransformers.

ComfyUI's SpatialTransformer turns its (b, h*w, c) tokens back into an image with
`reshape(b, h, w, c).movedim(3, 1).contiguous()`: for a channels_last UNet that `.contiguous()` copies
the activation into NCHW, then cuDNN converts it back for the channels_last proj_out convolution, and the
residual `x + x_in` mixes the two layouts (a strided, non-vectorised add). Measured on the H200 (SD1.5
512², patched eager forward): about 50 such kernels per step, ~0.7 ms of a 7.4 ms step.

The stand-in below is a subclass clone of the host's SpatialTransformer (same children, same parameter
names, `isinstance` still true) whose forward does the same computation with views that keep the input's
memory format: tokens are `movedim(1, 3).reshape(b, h*w, c)` (a view for channels_last input, the same
copy as the host's for NCHW) and the image is `reshape(b, h, w, c).movedim(3, 1)` (a channels_last view).
It is planned only for classes whose forward has the signature it reproduces, and only by the
channels_last option: for an NCHW UNet the host's own forward is already the right one.

SD1.5's proj_in / proj_out are 1x1 convolutions (use_linear=False). On a channels_last image
`x.permute(0, 2, 3, 1)` is a contiguous [N, H, W, C] view, so such a convolution is one GEMM over the
pixels, `F.linear(view, w.view(C_out, C_in), bias)`, whose bias cuBLAS adds in the GEMM's epilogue:
cuDNN's convolution adds its bias in a broadcast kernel of its own, a full pass over the output. proj_in's
GEMM writes the tokens directly; proj_out's result, permuted back, is channels_last with no copy. The
weights are read through the host's casting (`fused_modules.weights_of`); anything else (other kernel
sizes, NCHW input, Forge's manual-cast modules) runs the module itself.
"""
import torch.nn.functional as F
from torch import nn

from . import fused_modules as fm
from . import stock_path

_SIGNATURE = ("self", "x", "context", "transformer_options")


class ChannelsLastSpatialTransformer:
    sdaccel_kind = "layout"

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's own signature
        if stock_path.LOCAL.depth or stock_path.compiling() or fm.host_replaced(self):
            return fm.original_class(self).forward(self, x, context=context, transformer_options=transformer_options)
        blocks = self.transformer_blocks
        if not isinstance(context, list):
            context = [context] * len(blocks)
        b, _, h, w = x.shape
        if self.sdaccel_sets_activations_shape:
            transformer_options["activations_shape"] = list(x.shape)
        x_in = x
        x = self.norm(x)
        gemm = None if self.use_linear else gemm_weights(self.proj_in, x)
        if gemm is not None:
            # the 1x1 conv as a GEMM over the pixels (bias in cuBLAS's epilogue), straight to tokens
            x = F.linear(x.permute(0, 2, 3, 1).reshape(b, h * w, x.shape[1]), *gemm)
        else:
            if not self.use_linear:
                x = self.proj_in(x)
            x = x.movedim(1, 3).reshape(b, h * w, x.shape[1])
            if self.use_linear:
                x = self.proj_in(x)
        for i, block in enumerate(blocks):
            transformer_options["block_index"] = i
            x = block(x, context=context[i], transformer_options=transformer_options)
        gemm = None if self.use_linear or x_in.dim() != 4 else gemm_weights(self.proj_out, x_in, x)
        if gemm is not None and x.dtype == x_in.dtype:
            # GEMM with the bias in its epilogue, then the residual added in place, both operands
            # contiguous NHWC (a vectorised add): two passes. torch.addmm with x_in as its C operand would
            # not make it one: with a separate output it first copies C there (a pass), and its bias,
            # out of the epilogue then, would need a pass of its own; in place into x_in it would
            # overwrite the block's input, which the caller (or another pack's hook) may still hold.
            y = F.linear(x, *gemm).reshape(b, h, w, -1)
            y += x_in.permute(0, 2, 3, 1)
            return y.permute(0, 3, 1, 2)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.reshape(b, h, w, x.shape[-1]).movedim(3, 1)
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


def gemm_weights(conv, image, tokens=None):
    """(weight as [C_out, C_in], bias) when `conv` on the channels_last `image` is a plain 1x1 convolution
    that `F.linear` over the pixels computes (1x1 kernel, stride 1, no padding, one group), read through
    the host's casting (`weights_of`: LoRA, low-VRAM and manual-cast weights); else None, and the caller
    runs the module itself. `tokens`: the GEMM's input when it is not the image (proj_out)."""
    if not (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1)
            and conv.padding in ((0, 0), "valid") and conv.groups == 1):
        return None
    if getattr(conv, "parameters_manual_cast", False):      # Forge casts its own way: its forward
        return None
    if image.dim() != 4 or not image.permute(0, 2, 3, 1).is_contiguous():
        return None
    src = image if tokens is None else tokens
    w, bias = fm.weights_of(conv, src)
    if w.dim() != 4 or tuple(w.shape[2:]) != (1, 1) or w.dtype != src.dtype or w.device != src.device:
        return None
    if bias is not None and (bias.dtype != src.dtype or bias.device != src.device):
        return None
    return w.reshape(w.shape[0], w.shape[1]), bias


_STEPS = ("self.norm(x)", "self.proj_in(x)", "self.proj_out(x)", "block_index", "x + x_in", "use_linear")


def _host_forward_matches(cls):
    """None unless the host class's forward is the one this stand-in reproduces (its parameters and the
    same steps in its source); else what differs between host versions it does reproduce."""
    src = fm.host_source(cls, "forward", _SIGNATURE)
    if src is None or not all(step in src for step in _STEPS):
        return None
    return {"sets_activations_shape": "activations_shape" in src}


def is_spatial_transformer(m):
    cls = fm.original_class(m)
    return (cls.__name__ == "SpatialTransformer" and all(hasattr(m, a) for a in
            ("norm", "proj_in", "proj_out", "transformer_blocks", "use_linear")))


def make_channels_last_spatial_transformer(orig):
    base = fm.original_class(orig)
    info = _host_forward_matches(base)
    if info is None:
        return None
    new = fm.clone_as(ChannelsLastSpatialTransformer, orig)
    new.sdaccel_sets_activations_shape = info["sets_activations_shape"]
    return new


def plan_layout_patches(root, prefix=""):
    """{prefix + path: stand-in} for every SpatialTransformer of `root` whose forward is reproduced here.
    Never modifies `root`."""
    out = {}
    for name, mod in root.named_modules():
        if name and is_spatial_transformer(mod):
            new = make_channels_last_spatial_transformer(mod)
            if new is not None:
                out[prefix + name] = new
    return out
