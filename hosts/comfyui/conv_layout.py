"""The layout of a loaded model's conv weights around SD Accel's sampling runs.

The UNet's graphs are captured over channels_last conv weights (converted in place before the first capture,
hosts/comfyui/accelerate.py). The loaded model is the user's: stock KSampler and every other node run it too,
and on channels_last weights ComfyUI's own step runs slower (bench/RESULTS.md). So the weights are in that layout
only during our runs: converted at a run's first step, back after it (`back_to_stock_layout`, at the run's
end). Stock's layout is the one the model was loaded in (`patching.loaded_channels_last`: channels_last under
ComfyUI's --force-channels-last, where nothing is converted either way). Each conversion is a copy of the conv
weights into their own storage (a few ms for SDXL's on a fast GPU); the graphs stay valid, their pointers unchanged.
A VAE's weights are in that layout only during each decode or encode of its accelerated copy
(`stock_layout_between_calls`).
"""
import functools
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
    channels_last = channels_last or st.stock_channels_last
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


# the VAE methods nodes call (VAE Decode / Encode, their tiled versions, the inpainting encodes go through encode)
_ENTRY_METHODS = ("decode", "decode_tiled", "encode", "encode_tiled")
_LAYOUT_FORWARDS, _LAYOUT_DEPTH = "_sd_accel_layout_forwards", "_sd_accel_layout_depth"
_LAYOUT_CLASSES = {}   # the VAE's class -> its subclass whose entry methods put the layout back


def stock_layout_between_calls(acc, forwards):
    """On a VAE's accelerated copy (hosts/comfyui/vae_accel.py): each call of its decode / encode (and their tiled
    versions) leaves the conv weights in stock's layout when it returns. They are the user's VAE's, and a node that
    reads them without loading the VAE sees them as they are (VAE Save: safetensors refuses a channels_last tensor
    as non-contiguous). The next call converts them again before its first GPU call; the graphs stay valid (same
    storage). A call nested in another (a decode that falls back to the tiled one) leaves that to the outer one.
    The copy's class becomes a subclass of the VAE's class with those methods, so a copy of the copy behaves the
    same."""
    acc.__dict__[_LAYOUT_FORWARDS] = forwards
    acc.__class__ = _layout_class(type(acc))


def _layout_class(base):
    cls = _LAYOUT_CLASSES.get(base)
    if cls is None:
        methods = {name: _entry(base, name) for name in _ENTRY_METHODS if callable(getattr(base, name, None))}
        cls = _LAYOUT_CLASSES[base] = type(base.__name__, (base,), dict(methods, __module__=base.__module__))
    return cls


def _entry(base, name):
    fn = getattr(base, name)

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        depth = self.__dict__.get(_LAYOUT_DEPTH, 0)
        self.__dict__[_LAYOUT_DEPTH] = depth + 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.__dict__[_LAYOUT_DEPTH] = depth
            if not depth:
                _forwards_to_stock_layout(self.__dict__.get(_LAYOUT_FORWARDS, ()))
    return call


def _forwards_to_stock_layout(forwards):
    for gf in forwards:
        try:
            gf.to_stock_layout()
        except Exception as e:  # noqa: BLE001 - never lose the call's result (or its own error) to this
            log.warning("[SD Accel] VAE conv weights could not be put back in stock's layout: %s", e)
