"""A ResBlock whose first conv's bias and the timestep embedding go into the GroupNorm after them.

ComfyUI's (and ldm's) ResBlock computes `h = conv(silu(gn(x)))` (cuDNN adds the conv bias in its own
kernel), `h = h + emb_layers(emb)[..., None, None]` (a broadcast add), then `silu(gn(h))`. Both adds are
constant per (sample, channel), so `kernels.group_norm_silu(h, add=bias + emb)` folds them into the
norm's statistics: two full passes over the activation fewer per ResBlock (22 ResBlocks in an SD1.5
UNet). The arithmetic is the block's own, with the two adds done in fp32 instead of fp16.

The stand-in is a subclass clone (same children and parameter names, `isinstance` holds) overriding
`_forward` (ComfyUI's and ldm's `(x, emb)`, Forge's `(x, emb, transformer_options)`), planned only where it
reproduces the host's `_forward` exactly: a plain ResBlock (no up/down sampling, no scale-shift norm,
timestep embedding used, no exchanged dims), `in_layers` ending in a Conv2d, `out_layers` = [GroupNorm,
SiLU, Dropout (or Identity), Conv2d], and a host `_forward` whose source has the expected steps. The convolution's weights are read through the host's casting (`weights_of`).

The timestep-embedding projections of all the model's ResBlocks are computed together, once per forward, by
the first ResBlock that runs (engine/patches/emb_projections.py), where their weights are all on the device.

The block's end, `skip_connection(x) + out_layers(h)`, is folded the same way: the last convolution runs
without its bias (and so does a 1x1 skip convolution), and `kernels.bias_residual_add` adds both biases
and the residual in one pass, in place into the conv output, in its memory format. Torch would add each
bias in a broadcast kernel of its own (slow and not vectorised on channels_last) before the residual
add: up to two passes fewer per ResBlock. Only when the Dropout between is the identity (eval mode).
"""
from torch import nn

from ...kernels.bias_residual_add import bias_residual_add
from ...kernels.group_norm_silu import group_norm_silu
from . import emb_projections
from . import fused_modules as fm
from ..reports import kernel_report
from . import stock_path

_STEPS = ("self.in_layers(x)", "self.emb_layers(emb)", "h = h + emb_out", "self.out_layers(h)",
          "self.skip_connection(x) + h", "use_scale_shift_norm")
# ComfyUI's and ldm's `_forward(x, emb)`; Forge's takes transformer_options too (its group_norm_wrapper branches
# run only with that wrapper set, and the stand-in then calls Forge's own)
_PARAMS = (("self", "x", "emb"), ("self", "x", "emb", "transformer_options"))


class FusedResBlock:
    sdaccel_kind = "resblock"

    def _forward(self, x, emb, transformer_options=None):
        # transformer_options: Forge's ResBlock takes them, and hands its norms to a `group_norm_wrapper` in them
        if (stock_path.LOCAL.depth or stock_path.compiling() or fm.host_replaced(self)
                or fm.class_forward_replaced(type(self.out_layers[0]))
                or (transformer_options and "group_norm_wrapper" in transformer_options)):
            more = () if transformer_options is None else (transformer_options,)
            return fm.original_class(self)._forward(self, x, emb, *more)
        layers = self.in_layers
        h = x
        for i in range(len(layers) - 1):
            h = layers[i](h)
        conv = layers[len(layers) - 1]
        w, b = fm.weights_of(conv, h)
        h = conv._conv_forward(h, w, None)           # the bias goes into the norm's add
        shared = getattr(self, "sdaccel_emb_projections", None)
        add = shared.projection(self, emb) if shared is not None else None   # all ResBlocks' in one GEMM
        if add is None:
            add = self.emb_layers(emb).float()
            if b is not None:
                add = add + b.float()
        out = self.out_layers
        norm = out[0]
        nw, nb = fm.weights_of(norm, h) if norm.weight is not None else (None, None)
        h = group_norm_silu(h, norm.num_groups, nw, nb, norm.eps, activation="silu", add=add)
        kernel_report.record("resblock_add_norm", group_norm_silu.last_call)
        drop, conv = out[2], out[3]
        h = drop(h)
        if not identity_in_this_mode(drop):
            return self.skip_connection(x) + conv(h)
        # the last conv without its bias; bias (and a 1x1 skip conv's bias) + residual add in one pass
        w, b = fm.weights_of(conv, h)
        h = conv._conv_forward(h, w, None)
        skip = self.skip_connection
        rb = None
        if plain_conv(skip):
            sw, rb = fm.weights_of(skip, x)
            r = skip._conv_forward(x, sw, None)
        else:
            r = skip(x)
        h = bias_residual_add(h, r, b, rb, out=h)   # in place: h is this call's own temporary
        kernel_report.record("resblock_bias_residual", bias_residual_add.last_call)
        return h


def identity_in_this_mode(m):
    """Dropout in eval mode (or with p = 0) and Identity pass h through unchanged: only then is the fold
    the host block's arithmetic (a training-mode Dropout runs the host's own steps)."""
    if isinstance(m, nn.Identity):
        return True
    return isinstance(m, nn.Dropout) and (not m.training or m.p == 0)


def plain_conv(m):
    """A Conv2d whose forward is torch's or ComfyUI's casting one (so `_conv_forward` with the weights of
    `weights_of` is what it computes); Forge's manual-cast modules, and another ops class's (ComfyUI-GGUF's
    dequantizing one), are left to their own forward."""
    return isinstance(m, nn.Conv2d) and not getattr(m, "parameters_manual_cast", False) and fm.computes_plainly(m)


def eligible(m):
    """The module is a plain ResBlock whose `_forward` the stand-in reproduces."""
    cls = fm.original_class(m)
    src = None
    if cls.__name__ == "ResBlock":
        src = next(filter(None, (fm.host_source(cls, "_forward", params) for params in _PARAMS)), None)
    if src is None or not all(step in src for step in _STEPS):
        return False
    if getattr(m, "updown", True) or getattr(m, "use_scale_shift_norm", True):
        return False
    if getattr(m, "skip_t_emb", False) or getattr(m, "exchange_temb_dims", False):
        return False
    ins, out = getattr(m, "in_layers", None), getattr(m, "out_layers", None)
    if not (isinstance(ins, nn.Sequential) and isinstance(out, nn.Sequential) and len(out) == 4 and len(ins) >= 1):
        return False
    return (plain_conv(ins[len(ins) - 1]) and fm.is_group_norm(out[0]) and fm.is_silu(out[1])
            and isinstance(out[2], (nn.Dropout, nn.Identity)) and plain_conv(out[3]))


def plan_resblocks(root, prefix="", owner=None):
    """{prefix + path: stand-in} for every eligible ResBlock of `root`; never modifies `root`. The stand-ins
    share one EmbProjections (all their timestep-embedding projections in one GEMM) of `owner` (the live
    module `root` is a view of; default `root`)."""
    standins = {}
    for name, mod in root.named_modules():
        if name and eligible(mod):
            fm.host_forwards(type(mod.out_layers[0]))    # the out norm's forwards, as _forward compares them
            standins[prefix + name] = fm.clone_as(FusedResBlock, mod)
    emb_projections.attach(owner if owner is not None else root, list(standins.values()))
    return standins
