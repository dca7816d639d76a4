"""Which precision paths a ComfyUI model clone gets: FP8 compute for the transformers' Linears (precision "fp8",
LOSSY, sm_89/sm_90 only) and, for checkpoints stored in fp8, one upcast fp16 copy per weight where the GPU has room
(lossless: what ComfyUI's manual cast computes at every call, computed once), else a group of layers cast at a time
at each step (the same values). Each says why where it refuses."""
import logging

from ...engine.fp8 import support as fp8_support
from ...engine.fp8 import upcast as fp8_upcast
from ...engine.fp8 import weights as kept_weights

log = logging.getLogger("sd_accel")


def fp8_planned(clone, options, info):
    """True when the transformers' Linears are to run in FP8 (precision "fp8" on an sm_89/sm_90 GPU); else
    False, with the one-line reason in `info` where fp8 was asked for."""
    if options.precision != "fp8":
        return False
    why = fp8_support.refusal(getattr(clone, "load_device", None))
    if why:
        info["reasons"]["precision fp8"] = why
        log.info("[SD Accel] precision fp8: %s", why)
        return False
    return True


# what the kept fp16 copies of fp8-stored weights may leave of the GPU's memory for everything else, at least
_UPCAST_HEADROOM = 0.25


def keeps_derived_copies(clone, fp8, upcast):
    """True when the step makes weight copies of its own (FP8 weights, fp16 copies of fp8-stored ones, and the
    fp8-stored norms' fp16 copies, which the fused norms keep whatever `fp8_weights` says): a key's first step
    after a weight change then runs eagerly, so no copy is first made inside a capture (which fails it; with
    fp8_weights "as stored" every capture failed on a norm's copy and the steps ran eagerly, slower than stock)."""
    if fp8 or upcast:
        return True
    return any(p.dtype in kept_weights.FP8_DTYPES for p in clone.model.diffusion_model.parameters())


def upcast_planned(clone, info, on_cuda, fp8_weights="fp16 copies"):
    """How the model's fp8-stored weights (manual cast) are computed on its GPU: "copies" (one kept fp16 copy each,
    where `fp8_weights` asks for them and they fit, leaving _UPCAST_HEADROOM of the GPU for the activations),
    "grouped" (cast a group of layers at a time at each step: "as stored", or the copies do not fit; the reason
    in `info`), or None (no such weights, or not on a GPU)."""
    modules = [m for m in clone.model.diffusion_model.modules() if fp8_upcast.is_fp8_stored(m)]
    if not modules or not on_cuda:
        return None
    need = sum(m.weight.numel() * 2 for m in modules)
    if fp8_weights == "as stored":
        info["reasons"]["fp8-stored weights"] = ("kept as stored (fp8_weights 'as stored'): a group of layers cast at "
                                                 "a time at each step, instead of %.1f GiB of fp16 copies"
                                                 % (need / 2 ** 30))
        return "grouped"
    import comfy.model_management as mm
    total = mm.get_total_memory(clone.load_device)
    if total - clone.model_size() - need < _UPCAST_HEADROOM * total:
        info["reasons"]["fp8-stored weights"] = ("their fp16 copies (%.1f GiB) do not fit next to the model: a group "
                                                 "of layers cast at a time at each step" % (need / 2 ** 30))
        return "grouped"
    return "copies"
