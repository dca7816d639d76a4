"""CUDA graphs on A1111: the UNet step through `engine.graphs.step_graphs.StepGraphs`, reached through A1111's own
UNet hook, an `sd_unet.SdUnetOption` listed by `on_list_unets` (what the TensorRT extension uses). With "SD Unet" =
Automatic (A1111's default) it is picked for the loaded checkpoint while the toggle is on; A1111 deactivates it
before every weight reload. Its forward calls the stock UNet forward; the UNet's own `forward` is never rebound.
A graph's key holds what A1111 changes without changing the weights' identity (`host_state`).

Like hosts/a1111.py, it imports nothing from A1111: the caller passes A1111's `sd_unet` module and getters.
"""
import logging
import sys
import weakref

import torch

from ..engine.graphs.step_graphs import StepGraphs
from ..engine.graphs.tokens import Token
from . import a1111_lora, a1111_unet_hooks, webui
from .a1111 import _STATE_ATTR, _state, unet_of

log = logging.getLogger("sd_accel")

UNET_LABEL = "SD Accel (CUDA graphs)"


def _structure(unet, st):
    """`webui.structure_signature`, computed once per sampling run."""
    if st.structure is not None and st.structure[0] is st.epoch and st.epoch is not None:
        return st.structure[1]
    sig = webui.structure_signature(unet)
    st.structure = (st.epoch, sig)
    return sig


def host_state(unet, st):
    """What A1111 changes without changing the weights' identity: LoRA set (A1111 applies it lazily
    in forward, which a replay skips), hypernetworks, attention settings, autocast, module structure."""
    shared = sys.modules.get("modules.shared")
    hns = tuple(hypernetwork_state(h) for h in getattr(shared, "loaded_hypernetworks", ()) or ())
    opts = getattr(shared, "opts", None)
    attention = tuple(getattr(opts, name, None) for name in ATTENTION_OPTIONS)
    return (a1111_lora.wanted_names(), a1111_lora.functional(), hns, attention, webui.autocast_state(),
            _structure(unet, st))


# settings A1111's cross-attention optimisations read on every call (modules/sd_hijack_optimizations.py): a capture
# bakes in the branch each one took
ATTENTION_OPTIONS = ("upcast_attn", "sub_quad_q_chunk_size", "sub_quad_kv_chunk_size", "sub_quad_chunk_threshold")


def hypernetwork_state(h):
    """A loaded hypernetwork as a captured step reads it (its layers run inside the UNet's cross-attention): the
    object itself (one unloaded by a prompt without it and loaded again by a later one is a new object, its weights
    at new addresses), each layer's multiplier (A1111 sets the prompt's strength on the layers, a number the capture
    bakes in) and where each layer's weights are."""
    layers = [m for pair in (getattr(h, "layers", None) or {}).values() for m in pair]
    return (Token(h), getattr(h, "name", None), tuple(getattr(m, "multiplier", None) for m in layers),
            tuple(p.data_ptr() for m in layers for p in m.parameters()))


def graph_forward(unet, original_forward, x, timesteps, context, *args, **kwargs):
    """The UNet step through `StepGraphs` (eager, with the reason kept, when it cannot replay)."""
    st = _state(unet)
    if st.graphs is None:
        st.graphs = StepGraphs(unet, name=type(unet).__name__)

    def fn(*a, **k):
        with webui.capturable_timestep_embedding(unet):
            if torch.cuda.is_available() and torch.is_autocast_enabled("cuda"):
                # a graph must not reuse autocast's cast cache across replays
                with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
                    return original_forward(unet, *a, **k)
            return original_forward(unet, *a, **k)

    hooked = a1111_unet_hooks.refusal(unet, st)
    if hooked:
        return st.graphs.run_eager(fn, (x, timesteps, context) + args, kwargs, hooked)
    return st.graphs.run(fn, (x, timesteps, context) + args, kwargs, epoch=st.epoch,
                         host_state=host_state(unet, st), warm_after_change=bool(st.fp8))


def make_unet_option(sd_unet, get_sd_model, get_options, original_forward_for):
    """A1111's `SdUnetOption` for SD Accel's CUDA graphs.

    `sd_unet`: A1111's `modules.sd_unet`; `get_sd_model()`: the loaded model or None;
    `get_options()`: A1111Options; `original_forward_for(unet)`: the stock UNet forward (unbound),
    i.e. `sd_hijack.ldm_original_forward` or `sgm_original_forward`."""

    class SDAccelUnet(sd_unet.SdUnet):
        def activate(self):
            sd_model = get_sd_model()
            unet = unet_of(sd_model)
            if unet is not None:
                _state(unet).route_active = True
                self.unet_ref = weakref.ref(unet)
            # A1111 moves the stock UNet to the CPU before activating a replacement UNet; ours runs it
            if unet is not None and not getattr(sd_model, "lowvram", False):
                dev = getattr(sd_model, "device", None)
                if dev is not None:
                    unet.to(dev)
            log.info("[SD Accel] CUDA-graph UNet route active")

        def forward(self, x, timesteps, context, *args, **kwargs):
            unet = unet_of(get_sd_model())
            return graph_forward(unet, original_forward_for(unet), x, timesteps, context, *args, **kwargs)

        def deactivate(self):
            active = getattr(self, "unet_ref", lambda: None)()
            if active is not None:
                _state(active).route_active = False
            unet = unet_of(get_sd_model())
            st = unet.__dict__.get(_STATE_ATTR) if unet is not None else None
            if st is not None and st.graphs is not None:
                st.graphs.clear("UNet route deactivated (weights reload or setting change)")

    class SDAccelUnetOption(sd_unet.SdUnetOption):
        label = UNET_LABEL

        @property
        def model_name(self):
            # "Automatic" picks the option whose model_name is the loaded checkpoint's: ours, while on
            sd_model = get_sd_model()
            if unet_of(sd_model) is None or not get_options().want("cuda_graph"):
                return None
            info = getattr(sd_model, "sd_checkpoint_info", None)
            return getattr(info, "model_name", None)

        def create_unet(self):
            return SDAccelUnet()

    return SDAccelUnetOption()
