"""The unit of placement and streaming: a UNet cut into the modules that run one after another in a step, and
how many bytes of each unit's tensors are on a device. No ComfyUI import: it walks the attributes an ldm
`UNetModel` has (time_embed, label_emb, input_blocks, middle_block, output_blocks, out).

A stream unit is each child of a top-level block of ldm's UNetModel (a ResBlock, a Downsample or Upsample) and
each transformer block of a SpatialTransformer, the transformer's own layers joining the unit that runs next to
them (norm and proj_in the ResBlock before its blocks, proj_out its last block). Units smaller than a top-level
block keep the streaming ring small: SDXL's largest top-level block (ten transformer blocks) is 0.66 GiB, so a
ring holding two of them would take 1.32 GiB of a 4 GiB budget; its largest unit is 0.095 GiB, and what the
ring does not take stays resident instead of being copied every step (bench/RESULTS.md, "Device runs 36-43").
"""
import torch

from .pinned_memory import nbytes

# top-level children of ldm's UNetModel in the order its forward() runs them
_UNET_ORDER = ("time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out")

# a SpatialTransformer is split only when these are all its children, registered in the order its forward
# runs them (ComfyUI's and ldm's): norm, proj_in, the transformer blocks, proj_out
_TRANSFORMER_CHILDREN = {"norm", "proj_in", "transformer_blocks", "proj_out"}


def _split_transformer(child):
    names = [n for n, _ in child.named_children()]
    tb = getattr(child, "transformer_blocks", None)
    return (tb is not None and len(tb) > 0 and set(names) <= _TRANSFORMER_CHILDREN
            and names.index("transformer_blocks") == len([n for n in names if n in ("norm", "proj_in")]))


def stream_units(unet):
    """[(name, [modules])] of an ldm UNetModel in execution order, each unit's modules running one after
    another in a step (a unit is entered once per step), together holding every parameter under the top-level
    blocks: time_embed, label_emb, out whole; each child of input_blocks.i, middle_block, output_blocks.i
    ("input_blocks.4.0" a ResBlock, "output_blocks.2.2" an Upsample), a SpatialTransformer cut into its
    transformer blocks ("input_blocks.4.1.transformer_blocks.0"), its norm and proj_in joining the unit before
    it (they run right after it), its proj_out its last block's. A top-level block that is not a sequence of
    children (extensions) is one unit under its own name."""
    units = []
    for attr in _UNET_ORDER:
        mod = getattr(unet, attr, None)
        if mod is None:
            continue
        if attr in ("input_blocks", "output_blocks"):
            blocks = [("%s.%d" % (attr, i), b) for i, b in enumerate(mod)]
        elif attr == "middle_block":
            blocks = [(attr, mod)]
        else:
            units.append((attr, [mod]))
            continue
        for bname, block in blocks:
            children = list(block.named_children())
            if not children or any(p is not None for p in block._parameters.values()):
                units.append((bname, [block]))
                continue
            first = len(units)
            for cname, child in children:
                cpath = "%s.%s" % (bname, cname)
                if not _split_transformer(child):
                    units.append((cpath, [child]))
                    continue
                for gname, g in child.named_children():
                    if gname == "transformer_blocks":
                        units.extend(("%s.transformer_blocks.%d" % (cpath, k), [t]) for k, t in enumerate(g))
                    elif len(units) > first:
                        units[-1][1].append(g)      # norm, proj_in: the unit before; proj_out: the last block
                    else:
                        units.append((cpath, [g]))  # a block that starts with its transformer
    return units


def _param_bytes(modules):
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def unet_block_sizes(unet):
    """[(name, parameter bytes)] of an ldm UNetModel's stream units (`stream_units`), in execution order. Any
    other top-level child holding parameters (extensions of the class) follows, under its attribute name, so
    the sizes add up to the model's parameter bytes."""
    out, seen = [], set(a for a in _UNET_ORDER if getattr(unet, a, None) is not None)
    for name, mods in stream_units(unet):
        out.append((name, _param_bytes(mods)))
    for name, mod in unet.named_children():
        if name not in seen:
            n = _param_bytes([mod])
            if n:
                out.append((name, n))
    direct = sum(p.numel() * p.element_size() for p in unet.parameters(recurse=False))
    if direct:
        out.append(("(own parameters)", direct))
    return out


# -- the tensors of a unit -------------------------------------------------------------------------------------

def unit_modules(unit):
    """Every module under a unit (a module or a list of them), each once."""
    seen = set()
    for root in (unit if isinstance(unit, (list, tuple)) else [unit]):
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                yield m


def owned_tensors(unit):
    """(owner, tensor) for every parameter and buffer under `unit` (a module or a list of them), each once."""
    seen, out = set(), []
    for m in unit_modules(unit):
        for d in (m._parameters, m._buffers):
            for t in d.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, t))
    return out


def off_device_bytes(unet, device):
    """{unit name: bytes of its tensors not on `device`} for the stream units, execution order."""
    device = torch.device(device)
    return {name: sum(nbytes(t) for _, t in owned_tensors(mod) if not is_on(t, device))
            for name, mod in stream_units(unet)}


def on_device_bytes(module, device):
    """Bytes of the parameters and buffers under `module` that are on `device`."""
    device = torch.device(device)
    return sum(nbytes(t) for _, t in owned_tensors(module) if is_on(t, device))


def is_on(t, device):
    """`t` is on `device` (any index when `device` has none)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)
