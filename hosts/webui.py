"""What the AUTOMATIC1111 and Forge hosts share: the settings, the report helpers, and the pieces of the
graph path that both WebUIs' UNets need (their `timestep_embedding` copies its frequencies to the device on
every call, which a CUDA-graph capture refuses).

Imports nothing from either WebUI: `scripts/sd_accel.py` passes in what it reads from them.
"""
import contextlib
import inspect
import math
import sys
from collections import Counter
from dataclasses import dataclass, fields

import torch

from ..engine.patches import fused_modules
from ..engine.reports import kernel_report

PREFIX = "sd_accel_"
# (section id, title, category id): A1111 1.6+ and Forge group settings sections by category; "sd" is
# "Stable Diffusion", the category of the "Optimizations" section, where users look for speed settings.
SECTION = ("sd_accel", "SD Accel")
CATEGORY = "sd"


@dataclass(frozen=True)
class WebUIOptions:
    enabled: bool = True
    fused_kernels: bool = True
    cuda_graph: bool = True
    channels_last: bool = True
    precision: str = "fp16"       # "fp8": LOSSY, opt-in (A1111: hosts/a1111_fp8.py; Forge: not offered)

    def want(self, name):
        return bool(self.enabled and getattr(self, name))

    def fp8(self):
        return self.enabled and self.precision == "fp8"


# the settings that take one of several values (a radio in the settings page), with their values
CHOICES = {"precision": ("fp16", "fp8")}


# (field, label, info) of every setting; the key is PREFIX + field, the default WebUIOptions'.
SETTINGS = (
    ("enabled", "Enable SD Accel",
     "master switch: off restores the UNet's original modules"),
    ("fused_kernels", "Fused kernels (GroupNorm+SiLU, LayerNorm, GEGLU)",
     "Triton kernels on CUDA; the stock torch ops elsewhere"),
    ("cuda_graph", "CUDA graphs for the UNet step",
     "CUDA only; A1111: works through 'SD Unet' = Automatic; replays are dropped when weights or LoRAs change"),
    ("channels_last", "channels_last conv weights",
     "CUDA only; values unchanged"),
    ("precision", "Precision (fp8 is LOSSY)",
     "fp16: the model's own, lossless. fp8: LOSSY, the feed-forward GEGLU projections in FP8 e4m3 on Ada/Hopper "
     "GPUs (sm_89/sm_90), the image changes slightly; elsewhere, and on Forge, fp16 with the reason in the console"),
)


def setting_key(name):
    return PREFIX + name


def options_from(opts):
    """WebUIOptions from the WebUI's `shared.opts` (missing keys: defaults)."""
    d = {}
    for f in fields(WebUIOptions):
        value = getattr(opts, setting_key(f.name), f.default)
        if f.name in CHOICES:
            d[f.name] = value if value in CHOICES[f.name] else f.default
        else:
            d[f.name] = bool(value)
    return WebUIOptions(**d)


def replacement_counts(replacements):
    """{op: modules} of a {path: replacement} map, every replacement counted once, so the counts add up to
    the number of modules replaced: a GroupNorm with the SiLU after it fused is `group_norm_silu`, the SiLU
    slot it leaves (an identity) is `silu_folded`."""
    counts = Counter()
    for m in replacements.values():
        kind = getattr(m, "sdaccel_kind", None)
        if kind == "group_norm" and getattr(m, "sdaccel_act", None):
            kind = "group_norm_silu"
        if kind:
            counts[kind] += 1
    return dict(counts)


def folded_partner(path):
    """The SiLU slot that goes with the fused norm at `path` (`in_layers.0` -> `in_layers.1`), or None."""
    parent, _, last = path.rpartition(".")
    if not last.isdigit():
        return None
    return "%s.%d" % (parent, int(last) + 1) if parent else str(int(last) + 1)


def drop_with_partners(patches, paths):
    """`patches` without `paths`; a fused norm+SiLU and the folded SiLU after it go only together (a
    folded SiLU without its fused norm would skip the SiLU, a fused norm+SiLU before the stock SiLU
    would apply it twice)."""
    dropped = set(paths)
    for path, rep in patches.items():
        partner = folded_partner(path) if getattr(rep, "sdaccel_act", None) else None
        if partner is not None and (partner in dropped) != (path in dropped):
            dropped.update((path, partner))
    return {p: m for p, m in patches.items() if p not in dropped}


def kernel_summary(before=None):
    """Fused/fallback calls per op since `before` (a kernel_report.snapshot(); None: since start)."""
    return kernel_report.summarize(before or (Counter(), {}), kernel_report.snapshot())


def graph_status(graphs):
    """A StepGraphs' counters for a WebUI's status route: its stats, the last reason a call ran eagerly, and every
    reason calls ran without graphs (another extension's hook among them)."""
    if graphs is None:
        return {}
    out = dict(graphs.stats)
    if graphs.last_eager_reason:
        out["last_eager_reason"] = graphs.last_eager_reason
    if graphs.refused:
        out["refused"] = dict(graphs.refused)
    return out


def count_fused(root):
    return sum(1 for m in root.modules() if fused_modules.is_fused(m))


def structure_signature(root):
    """Module classes and their forwards, and hook counts: a class swap (ToMe), an attention optimisation
    switched by the WebUI, or a hook added by another extension makes a new graph key."""
    classes, hooks = {}, 0
    for m in root.modules():
        c = type(m)
        classes.setdefault(c, c.__dict__.get("forward") or getattr(c, "forward", None))
        hooks += len(m._forward_hooks) + len(m._forward_pre_hooks)
    return (tuple(sorted((c.__module__ + "." + c.__qualname__, id(f)) for c, f in classes.items())), hooks)


def autocast_state():
    if not torch.cuda.is_available():
        return None
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


_freqs = {}   # (half, max_period, device) -> the sinusoid frequencies, already on the device


def graphable_timestep_embedding(original):
    """ldm's (sgm's, Forge's) `timestep_embedding`, with the frequencies built on the CPU exactly as there
    (so the result is bitwise the same) but copied to the device once and kept: the original copies them on
    every call, and a host-to-device copy from pageable memory cannot be captured in a CUDA graph.
    The graph's eager warm-up call always fills the cache before a capture needs it."""
    def timestep_embedding(timesteps, dim, max_period=10000, repeat_only=False):
        if repeat_only:
            return original(timesteps, dim, max_period, repeat_only)
        half = dim // 2
        key = (half, max_period, timesteps.device)
        freqs = _freqs.get(key)
        if freqs is None:
            freqs = _freqs[key] = torch.exp(
                -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half
            ).to(device=timesteps.device)
        args = timesteps[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding
    timestep_embedding.sd_accel_original = original
    return timestep_embedding


_LDM_EMBEDDING = ("timesteps", "dim", "max_period", "repeat_only")


def _is_ldm_embedding(fn):
    """Only ldm's signature is reproduced (another model's function of that name, Flux's with its
    time_factor, say, is left alone)."""
    try:
        return tuple(inspect.signature(fn).parameters) == _LDM_EMBEDDING
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def capturable_timestep_embedding(unet):
    """For the duration of one graph-path call, the module that defines `unet`'s class uses
    `graphable_timestep_embedding` (a no-op when that module has no `timestep_embedding` of ldm's signature)."""
    mod = sys.modules.get(type(unet).__module__)
    original = getattr(mod, "timestep_embedding", None)
    if original is None or getattr(original, "sd_accel_original", None) is not None or not _is_ldm_embedding(original):
        yield
        return
    mod.timestep_embedding = graphable_timestep_embedding(original)
    try:
        yield
    finally:
        mod.timestep_embedding = original
