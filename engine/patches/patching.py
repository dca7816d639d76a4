"""Finds what to replace in an ldm-style UNet (or ControlNet) and returns it as data.

`plan_patches(root)` walks the module tree and returns `{attribute path: replacement module}`; it never
modifies the tree. The ComfyUI host turns each entry into `ModelPatcher.add_object_patch`; A1111 uses
`apply_patches`/`restore` below. Both are reversible and re-planning an already patched tree yields the
same patches (replacements of replacements are built from the host class, sharing the same tensors).

Targets, matched by structure rather than by class name where possible:
  * a GroupNorm directly followed by a SiLU in an nn.Sequential (ResBlock `in_layers`, `out_layers`,
    the UNet's final `out`)  -> fused GroupNorm+SiLU, and the SiLU slot -> SiLUFolded (identity);
    except in a ResBlock with `use_scale_shift_norm`, whose forward applies the scale/shift between the
    norm and the SiLU: there only the norm is fused;
  * any other GroupNorm (SpatialTransformer.norm) -> fused GroupNorm;
  * LayerNorm over the last dim (transformer blocks' norm1/2/3) -> fused LayerNorm;
  * GEGLU (`ff.net.0`) -> fused GEGLU that keeps its `proj` Linear;
  * with the op "resblock_add_norm" (ComfyUI host): plain ResBlocks -> a stand-in that folds the first
    conv's bias and the timestep embedding into the following GroupNorm (engine/patches/fused_resblock.py);
  * with the op "transformer_add_norm" (ComfyUI host): BasicTransformerBlocks -> a stand-in whose residual
    adds run inside norm2 and norm3 (engine/patches/fused_transformer_block.py). Planned first: ComfyUI sets the
    patches of a block's children (its fused norms) through the block's path, so onto the stand-in.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from . import fused_modules as fm
from . import fused_resblock, fused_transformer_block
from ..fp8 import weights as fp8_weights
from ..memory import residency

ALL_OPS = ("group_norm_silu", "group_norm", "layer_norm", "geglu")
COMFY_OPS = ALL_OPS + ("resblock_add_norm", "transformer_add_norm")


@dataclass
class PatchPlan:
    patches: dict = field(default_factory=dict)     # path -> replacement module
    counts: dict = field(default_factory=dict)      # op -> how many modules
    ops: dict = field(default_factory=dict)         # path -> the op it counts under (None: counted with another)
    pairs: dict = field(default_factory=dict)       # path -> the path it only works with (GroupNorm+SiLU's two)

    def add(self, path, module, op):
        self.patches[path] = module
        self.ops[path] = op
        if op:
            self.counts[op] = self.counts.get(op, 0) + 1

    def without(self, paths):
        """The plan less the patches at `paths` (and the pair of any of them), counted again."""
        paths = set(paths) | {self.pairs[p] for p in paths if p in self.pairs}
        out = PatchPlan()
        for path, module in self.patches.items():
            if path not in paths:
                out.add(path, module, self.ops[path])
                if path in self.pairs:
                    out.pairs[path] = self.pairs[path]
        return out


def _join(prefix, name):
    return "%s.%s" % (prefix, name) if prefix else name


def plan_patches(root, ops=ALL_OPS, prefix="", owner=None):
    """`root`: the UNet/ControlNet module; `prefix`: prepended to every path as is
    (ComfyUI's object patches are relative to BaseModel: "diffusion_model."). `owner`: the live module when
    `root` is a stand-in view of it (hosts/comfyui/object_patches.py plans on the unpatched blocks), which
    the ResBlocks' shared projection reads a block streamer's token from."""
    plan = PatchPlan()
    handled = set()
    if "transformer_add_norm" in ops:
        for path, mod in fused_transformer_block.plan_transformer_blocks(root, prefix).items():
            plan.add(path, mod, "transformer_add_norm")
    for name, mod in root.named_modules():
        if isinstance(mod, nn.Sequential):
            _plan_sequential(plan, handled, root, name, mod, ops, prefix)
    for name, mod in root.named_modules():
        if not name or name in handled:
            continue
        if fm.is_group_norm(mod) and "group_norm" in ops:
            plan.add(prefix + name, fm.make_fused_group_norm(mod, None), "group_norm")
        elif fm.is_layer_norm(mod) and "layer_norm" in ops:
            plan.add(prefix + name, fm.make_fused_layer_norm(mod), "layer_norm")
        elif fm.is_geglu(mod) and "geglu" in ops:
            plan.add(prefix + name, fm.make_fused_geglu(mod), "geglu")
    if "resblock_add_norm" in ops:
        for path, mod in fused_resblock.plan_resblocks(root, prefix, owner).items():
            plan.add(path, mod, "resblock_add_norm")
    return plan


def _plan_sequential(plan, handled, root, name, seq, ops, prefix):
    children = list(seq.named_children())
    parent = root.get_submodule(name.rsplit(".", 1)[0]) if "." in name else root
    scale_shift = name.endswith("out_layers") and getattr(parent, "use_scale_shift_norm", False)
    for (n0, m0), (n1, m1) in zip(children, children[1:]):
        if not (fm.is_group_norm(m0) and fm.is_silu(m1)):
            continue
        p0, p1 = _join(name, n0), _join(name, n1)
        if scale_shift or "group_norm_silu" not in ops:
            continue   # left to the plain GroupNorm rule (or to the host) below
        plan.add(prefix + p0, fm.make_fused_group_norm(m0, "silu"), "group_norm_silu")
        plan.add(prefix + p1, fm.SiLUFolded(), None)
        plan.pairs[prefix + p0], plan.pairs[prefix + p1] = prefix + p1, prefix + p0
        handled.update((p0, p1))


# -- hosts without object patches (A1111) ---------------------------------------------------------

def get_attr(root, path):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def set_attr(root, path, value):
    parent, _, last = path.rpartition(".")
    owner = get_attr(root, parent) if parent else root
    old = getattr(owner, last)
    setattr(owner, last, value)
    return old


def apply_patches(root, patches):
    """Applies {path: module}; returns {path: original} to hand back to `restore`."""
    backup = {}
    for path, module in patches.items():
        backup[path] = set_attr(root, path, module)
    return backup


def restore(root, backup):
    for path, module in backup.items():
        set_attr(root, path, module)


# -- memory format --------------------------------------------------------------------------------

def convert_conv_weights(root, memory_format=torch.channels_last):
    """Stores every 4-D conv weight of `root` in `memory_format`, in place (values unchanged, the
    Parameter objects kept): with channels_last activations cuDNN then needs no NCHW<->NHWC transform
    around each convolution. Stock ComfyUI's --force-channels-last does the same to the whole model.
    Converting back and forth keeps every graph captured over the weights valid (same storage, same kind of
    tensor). Returns how many weights changed. Weights a block streamer (engine/memory/offload.py) holds in its GPU ring are
    converted through it: their host copies change layout, and the ring view follows."""
    streamer = residency.streamer_of(root)
    n = 0
    for m in root.modules():
        if isinstance(m, nn.Conv2d) and m.weight is not None and m.weight.dim() == 4:
            w = m.weight
            if streamer is not None and streamer.relayout(w, memory_format):
                n += 1
                continue
            # an fp8-stored weight itself is relaid too, though the convolution reads its kept copy: a copy made later
            # (after a LoRA patch) inherits the weight's layout, and must have the one a later relayout assumes
            n += _relayout_data(w, memory_format)
            # an fp8-stored weight's kept fp16 copy is what the convolution reads: same layout, same storage
            for copy in fp8_weights.upcast_copies_of(w):
                _relayout_data(copy, memory_format)
    return n


def loaded_channels_last(root):
    """Whether `root`'s conv weights are channels_last as the host loaded them (ComfyUI's --force-channels-last,
    A1111's --opt-channelslast): then that is stock's layout, which SD Accel's runs leave them in. Read when SD
    Accel first meets the model, before it converts anything; a 1x1 kernel is contiguous in both layouts, so the
    others tell."""
    spatial = [m.weight for m in root.modules() if isinstance(m, nn.Conv2d) and m.weight is not None
               and m.weight.dim() == 4 and m.weight.shape[-1] * m.weight.shape[-2] > 1]
    return bool(spatial) and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                                 for w in spatial)


def _relayout_data(t, memory_format):
    """`t`'s data in `memory_format` in its own storage (`relayout_in_place`), the tensor object kept; 1 if it changed.
    New data of the same kind as the old (weights loaded under inference_mode have no version counter): a graph's
    weights fingerprint reads the same before and after."""
    if t.is_contiguous(memory_format=memory_format):
        return 0
    with torch.no_grad(), torch.inference_mode(t.is_inference()):
        t.data = relayout_in_place(t.data, memory_format)
    return 1


def relayout_in_place(t, memory_format):
    """`t`'s values in `memory_format`, written back into `t`'s own storage where it covers exactly the
    tensor (a dense weight, NCHW or channels_last): the weights stay where the loader put them, and graphs
    captured over them stay valid. A new copy instead would free
    the old storage and leave holes among the loaded weights, which the allocator cannot give back (the
    soak's reserved memory stayed 0.7 GiB above allocated; SD1.5's conv weights are 1.1 GiB). The
    transient copy is freed at once. Anything else (a view into a larger buffer, odd strides): a new copy."""
    dense = t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
    if not dense or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.contiguous(memory_format=memory_format)
    tmp = t.contiguous(memory_format=memory_format)
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset(), t.shape, tmp.stride())
    out.copy_(tmp)
    return out
