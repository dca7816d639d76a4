"""Which precision paths a ComfyUI model clone gets: FP8 compute for the transformers' Linears (precision "fp8",
LOSSY, sm_89/sm_90 only) and, for checkpoints stored in fp8, one upcast fp16 copy per weight where the GPU has room
(lossless: what ComfyUI's manual cast computes at every call, computed once). Each says why where it refuses."""
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
    """True when the model has fp8-stored weights (manual cast), `fp8_weights` asks for fp16 copies and they fit on
    its GPU, leaving _UPCAST_HEADROOM of it for the activations; else False (with the reason where it has such
    weights)."""
    modules = [m for m in clone.model.diffusion_model.modules() if fp8_upcast.is_fp8_stored(m)]
    if not modules or not on_cuda:
        return False
    need = sum(m.weight.numel() * 2 for m in modules)
    if fp8_weights == "as stored":
        info["reasons"]["fp8-stored weights"] = ("kept as stored (fp8_weights 'as stored'): cast per call, as ComfyUI "
                                                 "does, instead of %.1f GiB of fp16 copies" % (need / 2 ** 30))
        return False
    import comfy.model_management as mm
    total = mm.get_total_memory(clone.load_device)
    if total - clone.model_size() - need < _UPCAST_HEADROOM * total:
        info["reasons"]["fp8-stored weights"] = ("their fp16 copies (%.1f GiB) do not fit next to the model: "
                                                 "cast per call, as ComfyUI does" % (need / 2 ** 30))
        return False
    return True
