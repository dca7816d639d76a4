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
"""
from . import fused_modules as fm

_SIGNATURE = ("self", "x", "context", "transformer_options")


class ChannelsLastSpatialTransformer:
    sdaccel_kind = "layout"

    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's own signature
        blocks = self.transformer_blocks
        if not isinstance(context, list):
            context = [context] * len(blocks)
        b, _, h, w = x.shape
        if self.sdaccel_sets_activations_shape:
            transformer_options["activations_shape"] = list(x.shape)
        x_in = x
        x = self.norm(x)
        if not self.use_linear:
            x = self.proj_in(x)
        x = x.movedim(1, 3).reshape(b, h * w, x.shape[1])
        if self.use_linear:
            x = self.proj_in(x)
        for i, block in enumerate(blocks):
            transformer_options["block_index"] = i
            x = block(x, context=context[i], transformer_options=transformer_options)
        if self.use_linear:
            x = self.proj_out(x)
        x = x.reshape(b, h, w, x.shape[-1]).movedim(3, 1)
        if not self.use_linear:
            x = self.proj_out(x)
        return x + x_in


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
