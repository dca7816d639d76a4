"""The layout of a loaded model's conv weights around SD Accel's sampling runs.

The UNet's graphs are captured over channels_last conv weights (converted in place before the first capture,
hosts/comfyui/accelerate.py). The loaded model is the user's: stock KSampler and every other node run it too,
and on channels_last weights ComfyUI's own step runs slower (bench/RESULTS.md). So the weights are in that layout
only during our runs: converted at a run's first step, back after it (`back_to_stock_layout`, at the run's
end). Each conversion is a copy of the conv weights into their own storage (a few ms for SDXL's on a fast
GPU); the graphs stay valid, their pointers unchanged.
"""
import logging

import torch
from torch import nn

from ...engine.memory import residency
from ...engine.patches import patching

log = logging.getLogger("sd_accel")


def set_layout(st, base_model, channels_last):
    """Conv weights in the layout the graphs were captured over (channels_last), or back in stock's, in place
    (same storage: the graphs stay valid). Between our sampling runs the weights are in stock's layout: the
    loaded model is the user's, and stock KSampler or any other node then runs on it as without SD Accel
    (on channels_last weights ComfyUI's own step runs slower: bench/RESULTS.md). Weights a VRAM Pool streams keep
    the layout: their host copies would be rewritten every run."""
    unet = base_model.diffusion_model
    if st.channels_last_now == channels_last or residency.streamer_of(unet) is not None:
        return
    weights = list(_conv_weights(unet))
    if not weights or (channels_last and not all(w.is_cuda for w in weights)):
        return   # partly loaded: no graphs run, and rewriting host copies every run would cost the CPU
    patching.convert_conv_weights(unet, torch.channels_last if channels_last else torch.contiguous_format)
    st.channels_last_now = channels_last


def _conv_weights(unet):
    return (m.weight for m in unet.modules() if isinstance(m, nn.Conv2d) and m.weight is not None)


def back_to_stock_layout(st):
    """The conv weights of `st`'s model (None: no graph state) in stock's layout, if a run left them channels_last.
    Called where a sampling run ends: our node's run (hosts/comfyui/run.py), and current ComfyUI's OUTER_SAMPLE
    wrapper (any sampler node on a clone from Apply SD Accel)."""
    if st is None or not st.channels_last_now:
        return
    try:
        set_layout(st, st.graphs.fp.module, False)
    except Exception as e:  # noqa: BLE001 - never lose the run's result (or its own error) to this
        log.warning("[SD Accel] conv weights could not be put back in stock's layout: %s", e)
