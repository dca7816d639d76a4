"""The image VAE's ResnetBlocks with their norms, SiLUs, biases and residual add fused, and its other GroupNorms.

ComfyUI's (and ldm's) VAE ResnetBlock computes
    h = conv1(swish(norm1(x)));  h = conv2(dropout(swish(norm2(h))));  return shortcut(x) + h
with `swish` an nn.SiLU module and `shortcut` the identity, a 1x1 `nin_shortcut` or a 3x3 `conv_shortcut`. The
stand-in runs norm1 + SiLU as one kernel; conv1 without its bias, which is constant per channel and so goes into
norm2's statistics (`group_norm_silu(add=)`, as in fused_resblock.py); conv2 and the shortcut convolution without
their biases, which `bias_residual_add` adds with the residual in one pass, in place into conv2's output. The
arithmetic is the block's own, with those adds done in fp32 instead of the VAE's dtype.

Planned only where it reproduces the host's forward: a class named ResnetBlock whose own `forward(self, x, temb)`
has the steps in `_STEPS`, GroupNorm norms, an nn.SiLU swish, 2-D convolutions (a video VAE's VideoConv3d is left
to the host). At call time a timestep embedding, extra keywords, a non-4-D input, a training-mode Dropout or
another pack's forward of the block or of a class the stand-in computes send the call to the host's forward,
recorded with the reason. The decoder's and encoder's other GroupNorms (the attention block's `norm`, `norm_out`)
become fused GroupNorms; the SiLU after `norm_out` is a function call in the host's forward and stays there.
"""
from torch import nn

from ...kernels._dispatch import REFERENCE, Outcome
from ...kernels.bias_residual_add import bias_residual_add
from ...kernels.group_norm_silu import group_norm_silu
from ..reports import kernel_report
from . import fused_modules as fm
from . import stock_path
from .fused_resblock import identity_in_this_mode, plain_conv
from .patching import PatchPlan

_STEPS = ("self.norm1(h)", "self.swish(h)", "self.conv1(h)", "if temb is not None", "self.norm2(h)",
          "self.dropout(h)", "self.conv2(h)", "x+h")
OP_BLOCK = "vae_resnet_block"   # a block call that ran the host's forward, with why


class FusedVAEResnetBlock:
    sdaccel_kind = "vae_resnet"

    def forward(self, x, temb=None, **kwargs):
        why = _host_call_reason(self, x, temb, kwargs)
        if why is not None:
            if why:
                kernel_report.record(OP_BLOCK, Outcome(REFERENCE, why))
            return fm.original_class(self).forward(self, x, temb, **kwargs)
        h = _norm_silu(self.norm1, x, None)
        kernel_report.record("vae_norm_silu", group_norm_silu.last_call)
        w, b = fm.weights_of(self.conv1, h)
        h = self.conv1._conv_forward(h, w, None)     # its bias goes into norm2's statistics
        h = _norm_silu(self.norm2, h, b)
        kernel_report.record("vae_add_norm_silu", group_norm_silu.last_call)
        h = self.dropout(h)
        w, b = fm.weights_of(self.conv2, h)
        h = self.conv2._conv_forward(h, w, None)
        r, rb = _shortcut(self, x)
        h = bias_residual_add(h, r, b, rb, out=h)    # in place: h is this call's own temporary
        kernel_report.record("vae_bias_residual", bias_residual_add.last_call)
        return h


def _host_call_reason(m, x, temb, kwargs):
    """None when the stand-in computes this call; "" when the host's forward runs it as SD Accel means to
    (the stock path, another pack's forward); else the reason, for the report."""
    if stock_path.LOCAL.depth or stock_path.compiling() or fm.host_replaced(m) or \
            any(fm.class_forward_replaced(type(c)) for c in (m.norm1, m.norm2, m.swish)):
        return ""
    if temb is not None or kwargs:
        return "called with a timestep embedding or keywords"
    if x.dim() != 4:
        return "%d-D input" % x.dim()
    if not identity_in_this_mode(m.dropout):
        return "Dropout in training mode"
    return None


def _norm_silu(norm, x, add):
    w, b = fm.weights_of(norm, x) if norm.weight is not None else (None, None)
    return group_norm_silu(x, norm.num_groups, w, b, norm.eps, activation="silu", add=add)


def _shortcut(m, x):
    """(residual, its conv's bias or None): x itself, or the shortcut convolution without its bias."""
    if m.in_channels == m.out_channels:
        return x, None
    skip = m.conv_shortcut if m.use_conv_shortcut else m.nin_shortcut
    w, b = fm.weights_of(skip, x)
    return skip._conv_forward(x, w, None), b


def eligible(m):
    """`m` is a VAE ResnetBlock whose forward the stand-in reproduces (see the module's docstring)."""
    cls = fm.original_class(m)
    src = fm.host_source(cls, "forward", ("self", "x", "temb")) if cls.__name__ == "ResnetBlock" else None
    if src is None or not all(step in src for step in _STEPS):
        return False
    convs = [getattr(m, "conv1", None), getattr(m, "conv2", None)]
    if getattr(m, "in_channels", None) != getattr(m, "out_channels", None):
        convs.append(getattr(m, "conv_shortcut" if getattr(m, "use_conv_shortcut", False) else "nin_shortcut", None))
    return (all(fm.is_group_norm(getattr(m, n, None)) for n in ("norm1", "norm2"))
            and isinstance(getattr(m, "swish", None), nn.SiLU)
            and isinstance(getattr(m, "dropout", None), (nn.Dropout, nn.Identity))
            and all(isinstance(c, nn.Conv2d) and plain_conv(c) for c in convs))


def plan_vae(root, prefix=""):
    """PatchPlan of `root` (an image VAE: its encoder and decoder): a stand-in per eligible ResnetBlock and a
    fused GroupNorm for every other GroupNorm outside them; never modifies `root`."""
    plan = PatchPlan()
    blocks = []
    for name, mod in root.named_modules():
        if name and eligible(mod):
            for child in (mod.norm1, mod.norm2, mod.swish):
                fm.host_forwards(type(child))   # as the stand-in compares them at call time
            plan.add(prefix + name, fm.clone_as(FusedVAEResnetBlock, mod), "vae_resnet_block")
            blocks.append(name + ".")
    for name, mod in root.named_modules():
        if name and fm.is_group_norm(mod) and not any(name.startswith(b) for b in blocks):
            plan.add(prefix + name, fm.make_fused_group_norm(mod, None), "group_norm")
    return plan
