"""A module's whole forward replayed from CUDA graphs, as a stand-in for its `forward` attribute.

For models the host calls once per step outside the UNet's own wrapper: a ControlNet (ComfyUI calls
`control_model(x=, hint=, timesteps=, context=, ...)` before the UNet). Issuing one SD1.5 ControlNet
eagerly costs ~15 ms of CPU per step for ~5 ms of GPU work; a replay costs the GPU time. Where the host
runs the ControlNets inside the UNet's own graph (hosts/comfyui/control_graph.py), this stand-in is
called inside that graph's warm-up or capture and runs eagerly there (StepGraphs: no graphs of its own).

`GraphedForward(module)` is set as the instance attribute `forward` (nn.Module.__call__ looks it up
there first) through the host's reversible mechanism (a ComfyUI object patch on path "forward"); it
calls the class's own forward, so removing the attribute restores the module exactly. One per module
and options, kept on the module itself (`for_module`), so its graphs survive from one prompt to the
next; `StepGraphs` does the keying, static buffers and stale-weight checks (see step_graphs.py).

channels_last: the module's conv weights are converted in place before its first capture (values unchanged),
as the UNet's are, so its convolutions need no layout transforms inside the graphs either; back in stock's layout
when the host detaches the clone that holds the stand-in (`to_stock_layout`), so that stock nodes running the
same model afterwards run as without SD Accel.

A `Policy` says what differs from a ControlNet's (a VAE's decoder and encoder use one): the host's word on which
calls may replay (a decode's graph keeps its working memory reserved between calls, which the host bounds), how
many shapes are kept (a tiled decode has several), and whether the weights go to channels_last before the first
GPU call, graphed or not (a VAE decode is GPU-bound either way). Calls the policy refuses take the faster of the
fused and the stock modules (eager.EagerPaths), and so do calls without graphs (cuda_graph off), as the UNet's eager
steps do, unless the policy keeps them on the fused modules (`fused_without_graphs`: a VAE decode, GPU-bound).
`stock_tree`, set by the host: () -> a context manager around a stock-path call of this stand-in (the host's
cheaper stock tree for it: hosts/comfyui/stock_blocks.py), or None.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import logging
import weakref

import torch

from ..patches import patching
from .step_graphs import StepGraphs

log = logging.getLogger("sd_accel")
_ATTR = "_sd_accel_forwards"


@dataclass(frozen=True)
class Policy:
    refuse: Optional[Callable] = None   # (args, kwargs) -> why this call may not replay, or None
    max_graphs: int = 4                 # shapes kept before the module's graphs are dropped
    layout_first_call: bool = False     # channels_last before the first GPU call, not the first capture
    fused_without_graphs: bool = False  # calls without graphs run the fused modules, unmeasured


class GraphedForward:
    def __init__(self, module, name, cuda_graph=True, channels_last=True, policy=Policy()):
        # weakly: set as the module's own `forward`, a strong reference would be a cycle (module -> stand-in ->
        # module) that keeps a model the user dropped, and its VRAM, until a garbage collection runs (ComfyUI
        # leaves a loaded copy's object patches applied when it frees the copy's patcher)
        self._module = weakref.ref(module)
        self.forward = type(module).forward
        self.cuda_graph, self.channels_last = cuda_graph, channels_last
        self.policy = policy
        self.graphs = _graphs_of(module, name, policy.max_graphs, channels_last)
        self.epoch = None
        self.channels_last_done = False
        self.relayout_pending = False   # put back in stock's layout after graphs were captured: convert first
        self.channels_last_calls = 0    # calls that ran on channels_last weights (a host may put them back after each)
        self.layout_owner = lambda: None   # the host's word for who puts the layout back (ComfyUI: the newest clone)
        self.stock_tree = None             # see the module doc

    @property
    def module(self):
        return self._module()

    @classmethod
    def for_module(cls, module, name, cuda_graph=True, channels_last=True):
        """The one stand-in of `module` for these options (created on first use)."""
        forwards = module.__dict__.setdefault(_ATTR, {})
        key = (bool(cuda_graph), bool(channels_last))
        gf = forwards.get(key)
        if gf is None:
            gf = forwards[key] = cls(module, name, *key)
        return gf

    def new_run(self):
        """A sampling run starts: the weights are walked again once (see WeightsFingerprint)."""
        self.epoch = object()

    def __call__(self, *args, **kwargs):
        if ((self.policy.layout_first_call or self.relayout_pending) and _on_gpu(args, kwargs)
                and not torch.cuda.is_current_stream_capturing()):
            # graphs captured over channels_last weights replay only over them. Never inside another model's capture
            # (a ControlNet in the UNet's graph): the host settled the layout before it (settle_layout)
            self._to_channels_last()
        out = self._run(args, kwargs)
        if self.channels_last_done:
            self.channels_last_calls += 1
        return out

    def _run(self, args, kwargs):
        if not self.cuda_graph:
            if self.policy.fused_without_graphs:
                return self._eager(*args, **kwargs)
            return self._measured_eager(args, kwargs)
        why = self.policy.refuse(args, kwargs) if self.policy.refuse is not None else None
        if why is not None:
            return self.graphs.run_eager(self._eager, args, kwargs, why)
        return self.graphs.run(self._eager, args, kwargs, epoch=self.epoch, before_capture=self._to_channels_last)

    def _to_channels_last(self):
        """Before the first capture, and before the first call after `to_stock_layout`: conv weights to
        channels_last, values unchanged, in place (the graphs captured over them stay valid)."""
        if not self.channels_last or self.channels_last_done:
            return False
        n = patching.convert_conv_weights(self.module, torch.channels_last)
        self.channels_last_done, self.relayout_pending = True, False
        log.debug("[SD Accel] channels_last: %d conv weights of %s converted", n, self.graphs.name)
        return n > 0

    def settle_layout(self):
        """Outside any capture: the conv weights in the layout this stand-in's own calls would put them in
        (channels_last again after `to_stock_layout`), before a caller that captures this module inside a graph
        of its own (the UNet's, with the ControlNet in it) takes its key. Returns the layout: True for
        channels_last."""
        if self.relayout_pending and _on_gpu([next(self.module.parameters(), None)]):
            self._to_channels_last()
        return self.channels_last_done

    def to_stock_layout(self):
        """Conv weights back in stock's layout, in place, when the host stops running this stand-in (it detaches
        the clone that holds it): the weights are the user's model's, and its stock modules run slower on
        channels_last weights. The next call here converts them again; the graphs stay valid."""
        module = self.module   # None once the model is freed (a detach from the patcher's __del__)
        if self.channels_last_done and module is not None:
            patching.convert_conv_weights(module, torch.contiguous_format)
            self.channels_last_done = False
            self.relayout_pending = True

    def _eager(self, *args, **kwargs):
        return self.forward(self.module, *args, **kwargs)

    def _measured_eager(self, args, kwargs):
        """A call without graphs: the faster of the fused and the stock modules for its tensors' shapes and dtypes
        (only those: a key per call's other values would time every call and never choose)."""
        values = list(args) + [v for _, v in sorted(kwargs.items())]
        key = ("no graphs",) + tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                                     for v in values)
        device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.is_cuda), None)
        return self.graphs.eager_paths.run(key, self._eager, args, kwargs, device, self.stock_tree)


GRAPH_DEVICE = "cuda"   # the device type whose calls graphs serve (CPU tests stand the CPU in)


def _on_gpu(args, kwargs=None):
    """Whether the call has a tensor on the GPU, positional or keyword (ComfyUI calls a ControlNet with keywords
    only: `control_model(x=, hint=, timesteps=, context=)`)."""
    values = list(args) + list((kwargs or {}).values())
    return any(isinstance(a, torch.Tensor) and a.device.type == GRAPH_DEVICE for a in values)


def _graphs_of(module, name, max_graphs=4, channels_last=True):
    """One StepGraphs per module and layout, shared by its stand-ins of that layout: graph memory is bounded per
    module. A graph reads the conv weights by address in the layout it was captured over; a stand-in without
    channels_last runs over stock's layout, so it must never replay a graph captured over channels_last weights."""
    by_layout = module.__dict__.setdefault("_sd_accel_graphs", {})
    g = by_layout.get(bool(channels_last))
    if g is None:
        g = by_layout[bool(channels_last)] = StepGraphs(module, name=name, max_graphs=max_graphs)
    return g
