"""ComfyUI host, the VRAM Pool's clip output: the text encode under the pool's budget, measured as the "text
encode" stage, which the pool's next sampling run's report starts with (hosts/comfyui/memory.py)."""
import contextlib
import weakref

import torch

from ...engine.memory.vram_plan import GIB
from ...engine.reports import vram_report
from .memory_scopes import budget_scope, budget_supported, model_management


class NoClipConnected(AttributeError):
    """An AttributeError, so that probes (hasattr, copy's __deepcopy__ lookup) see a plain missing attribute."""


class NoClip:
    """The VRAM Pool's clip output when nothing is connected to its clip input: any use says so."""

    def __getattr__(self, name):
        raise NoClipConnected("VRAM Pool: its clip output is used (%s), but nothing is connected to its clip "
                              "input. Connect the checkpoint's CLIP to the VRAM Pool's clip input, or take the "
                              "CLIP from the loader directly." % name)


def pool_clip(clip, settings, mm=None):
    """A clone of `clip` whose encodes run as the pool's "text encode" stage: ComfyUI's loader sees the budget
    while it loads the text encoder (as it does for sampling: a text encoder larger than the budget is
    partially loaded, as --lowvram does), and the stage's peak allocated and reserved memory joins the report
    of the pool's next sampling run. The wrapper is an attribute of this clone: a CLIP cloned from it later
    (a LoRA loader after the pool) encodes the stock way, so connect this output to the text encoders."""
    out = clip.clone()
    # the clone weakly, and its class's encode (ComfyUI's scheduled encode calls this attribute too): the wrapper
    # is an attribute of the clone, and a reference to it (or its bound method) would be a cycle that keeps the
    # text encoder the user dropped, and its VRAM, until a garbage collection runs
    clone = weakref.ref(out)

    def encode_from_tokens(*args, **kwargs):
        c = clone()
        return text_stage(settings, c, lambda: type(c).encode_from_tokens(c, *args, **kwargs), mm)
    out.encode_from_tokens = encode_from_tokens
    out.sd_accel_pool = settings
    return out


def text_stage(settings, clip, run, mm=None):
    """Runs `run()` (one encode of the pool's CLIP) under the pool's budget, measured as "text encode"."""
    mm = mm or model_management()
    patcher = getattr(clip, "patcher", None)
    device = torch.device(getattr(patcher, "load_device", "cpu"))
    report, notes = vram_report.MemoryReport(), []
    with contextlib.ExitStack() as stack:
        budget = settings.budget_bytes
        if budget and device.type == "cuda":
            why = budget_supported(mm)
            total = mm.get_total_memory(device) if why is None else 0
            if why:
                notes.append("text encode: budget not enforced (%s)" % why)
            elif budget < total:
                stack.enter_context(budget_scope(mm, budget, total))
                notes.append("text encode under the budget (%.2f GiB)" % (budget / GIB))
        with report.stage("text encode", device):
            out = run()
    entry = report.stages[-1]
    old = settings.text_stage
    if old is None or (entry["peak_allocated"] or 0) >= (old["peak_allocated"] or 0):
        settings.text_stage = entry           # two encodes per prompt (positive, negative): the larger peak
    for n in notes:
        if n not in settings.text_notes:
            settings.text_notes.append(n)
    return out
