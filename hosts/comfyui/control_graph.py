"""ComfyUI host: the ControlNets of a step inside the UNet's CUDA graph, so a step is one graph replay.

ComfyUI's sampler calls `control.get_control(x, t, cond, batched_number[, transformer_options])` before
the UNet and hands the result (lists of residuals) to apply_model. With a graph per model, every step
copies the ControlNet's inputs into its graph, replays it, clones its outputs out, runs ComfyUI's strength
and merge as eager kernels, then copies the residuals into the UNet graph's static buffers and replays
that. Here the chain's forwards, strength and merge are captured in the UNet's graph instead.

How: each link of our converted chain (hosts/comfyui/controlnet.py, `one_graph`) gets an instance
attribute `get_control` (the class's method is untouched; the links are our per-run copies). Called by
the sampler, outside any capture, it takes every Python-side decision of ComfyUI's get_control at once:
  * which links are inside their start/end percent at this step: ComfyUI's own test,
    `t[0] > range[0] or t[0] < range[1]`, run here (inside a capture it would wait for the GPU), and
    skipped for the whole schedule (start 0, end 1), where it cannot fail and reading t would stall the step;
  * each active link's hint prepared for this shape and batch: ComfyUI's own get_control runs for that,
    with every link's ControlNet model stood in by a no-op (`_HintOnly`), so only the hint code runs;
and returns a `DeferredControl`: what the chain needs, not its result. The UNet's step
(hosts/comfyui/step_wrappers.py) turns it into graph inputs (`graph_inputs`: x, t, the conds, each hint, plus a
by-value description of each link: ControlNet module, strength, on/off...) and calls `evaluate` inside the
captured function, before the UNet: ComfyUI's own get_control on the graph's static inputs, with the
decisions taken: active links have no timestep range and their hint set to the static buffer, inactive
links pass the previous link's result through. A later prompt's new copies with the same description
replay the same graph; a new hint image is an input (copied in), a new strength, range or ControlNet is
another key. Steps where no link is active get None, so they use the UNet's graph without ControlNet.

Steps that cannot be deferred run ComfyUI's own get_control (the ControlNet's own graph, as before) and
the run report says why: a link that is not ours, extra hooks, weights not on the GPU, a strength that is
not a number, another capture under way, or another pack's wrapper outside ours on apply_model.
"""
import threading

import torch

from ...engine.graphs.fingerprint import WeightsFingerprint
from ...engine.graphs.tokens import Token

_tls = threading.local()
_MARK = "_sdaccel_one_graph"      # on each converted link: (stats, epoch)
_FP_ATTR = "_sd_accel_cn_fingerprint"
TAKES_DEFERRED = "sd_accel_takes_deferred_control"   # set on our apply_model wrapper


def install(link, stats, epoch):
    """Defers `link`'s get_control into the UNet's graph. `link` is our copy; `del link.get_control` undoes it."""
    link.__dict__[_MARK] = (stats, epoch)
    link.get_control = _get_control.__get__(link)


def new_stats():
    return {"deferred": 0, "stock": {}}


class _HintOnly:
    """Stands in for a ControlNet model while ComfyUI's get_control prepares the hints: no forward."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, *args, **kwargs):
        return []   # no residuals: ComfyUI's control_merge (both versions) then only merges the chain


class DeferredControl:
    """One step's ControlNet chain, decided but not run (see the module doc)."""

    def __init__(self, links, active, versions, x, t, cond, batched_number, pass_to):
        self.links, self.active, self.versions = links, active, versions
        self.x, self.t, self.cond, self.batched_number, self.pass_to = x, t, cond, batched_number, pass_to

    def graph_inputs(self):
        """Plain data for the graph's key and static inputs: tensors, and values that fix what is captured."""
        return {"links": [_describe(link, v) if on else ("off",)
                          for link, on, v in zip(self.links, self.active, self.versions)],
                "hints": [link.cond_hint if on else None for link, on in zip(self.links, self.active)],
                "x": self.x, "t": self.t, "cond": self.cond, "batched_number": self.batched_number}

    def evaluate(self, inputs, transformer_options=None):
        """The chain's residuals from `inputs` (graph_inputs' structure, possibly the graph's static copies)."""
        ev = _Evaluation(self.links, self.active, inputs["hints"])
        prev, _tls.evaluation = getattr(_tls, "evaluation", None), ev
        try:
            rest = (transformer_options if transformer_options is not None else {},) if self.pass_to else ()
            return self.links[0].get_control(inputs["x"], inputs["t"], inputs["cond"], inputs["batched_number"],
                                             *rest)
        finally:
            _tls.evaluation = prev


class _Evaluation:
    def __init__(self, links, active, hints):
        self.at = {id(link): i for i, link in enumerate(links)}
        self.active, self.hints = active, hints

    def call(self, link, stock, x, t, cond, batched_number, *rest, **kw):
        i = self.at[id(link)]   # every link that can be called here is in the chain decided from the top
        if not self.active[i]:   # outside its range: what ComfyUI returns then, the previous links' result
            prev = link.previous_controlnet
            return None if prev is None else prev.get_control(x, t, cond, batched_number, *rest, **kw)
        saved = link.timestep_range, link.cond_hint
        link.timestep_range, link.cond_hint = None, self.hints[i]
        try:
            return stock(link, x, t, cond, batched_number, *rest, **kw)
        finally:
            link.timestep_range, link.cond_hint = saved


def _get_control(self, x, t, cond, batched_number, *rest, **kw):
    stock = type(self).get_control
    ev = getattr(_tls, "evaluation", None)
    if ev is not None:
        return ev.call(self, stock, x, t, cond, batched_number, *rest, **kw)
    if getattr(_tls, "stock_depth", 0):   # a link below a top that runs ComfyUI's own code
        return stock(self, x, t, cond, batched_number, *rest, **kw)
    stats = self.__dict__[_MARK][0]
    links = _chain(self)
    why, active, versions = _decide(self, links, x, t, cond, batched_number, rest, kw)
    if why is not None:
        stats["stock"][why] = stats["stock"].get(why, 0) + 1
        return _stock_call(stock, self, x, t, cond, batched_number, rest, kw)
    stats["deferred"] += 1
    if not any(active):
        return None   # ComfyUI's result too: no link in range, the UNet runs without ControlNet
    view = {k: v for k, v in cond.items() if k not in ("control", "transformer_options")}
    return DeferredControl(links, active, versions, x, t, view, batched_number, pass_to=bool(rest) or bool(kw))


def _decide(top, links, x, t, cond, batched_number, rest, kw):
    """(why not, which links are in range, their weights' (version, layout)): the decisions taken outside the
    graph. Prepares the active links' hints on the way (ComfyUI's own code)."""
    why = _why_not(links, rest, kw)
    if why is not None:
        return why, None, None
    versions = [_weights_version(link) for link in links]
    layouts = [_settled_layout(link) for link in links]
    if getattr(x, "is_cuda", False) and not all(on_gpu for _, on_gpu in versions):
        return "ControlNet weights not all on the GPU", None, None
    active = [_in_range(link, t) for link in links]
    if not all(_hint_ready(link, x) for link, on in zip(links, active) if on):
        _prepare_hints(top, links, x, t, cond, batched_number, rest, kw)
        if not all(_hint_ready(link, x) for link, on in zip(links, active) if on):
            return "hint not prepared for this shape", None, None
    return None, active, [(v, layout) for (v, _), layout in zip(versions, layouts)]


def _settled_layout(link):
    """The layout of the link's conv weights (True: channels_last), settled outside the capture. The ControlNet's
    stand-in converts them for its own graphs and ComfyUI's detach puts them back; a UNet graph captured over
    one layout reads the weights' memory in that layout, so the layout is part of the key (the weights' version
    does not move: the conversion is in place) and a pending conversion happens here, never inside a capture."""
    gf = link.control_model.__dict__.get("forward")
    settle = getattr(gf, "settle_layout", None)
    return settle() if settle is not None else None


def _stock_call(stock, link, x, t, cond, batched_number, rest, kw):
    _tls.stock_depth = getattr(_tls, "stock_depth", 0) + 1
    try:
        return stock(link, x, t, cond, batched_number, *rest, **kw)
    finally:
        _tls.stock_depth -= 1


def _chain(top):
    links, link = [], top
    while link is not None:
        links.append(link)
        link = getattr(link, "previous_controlnet", None)
    return links


def _why_not(links, rest, kw):
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "another capture under way"
    for link in links:
        if _MARK not in link.__dict__:
            return "%s in the chain is not ours" % type(link).__name__
        if getattr(link, "extra_hooks", None) is not None:
            return "ControlNet with hooks"
        if not isinstance(link.strength, (int, float)):
            return "strength is not a number"
        if not all(_plain(v) for v in getattr(link, "extra_args", {}).values()):
            return "extra arguments that are not plain values"
    to = rest[0] if rest else kw.get("transformer_options")
    if isinstance(to, dict) and not _ours_outermost(to):
        return "another wrapper outside ours on apply_model"
    return None


def _plain(v):
    if isinstance(v, (list, tuple)):
        return all(_plain(i) for i in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _ours_outermost(transformer_options):
    try:
        import comfy.patcher_extension as pe
    except ImportError:
        return True
    wrappers = pe.get_all_wrappers(pe.WrappersMP.APPLY_MODEL, transformer_options)
    return bool(wrappers) and getattr(wrappers[0], TAKES_DEFERRED, False)


# ComfyUI's percent_to_sigma(0.0) is 999999999.9 and percent_to_sigma(1.0) is 0.0: a start/end percent of 0/1
FULL_RANGE_FROM, FULL_RANGE_TO = 999999999.0, 0.0


def _in_range(link, t):
    """ComfyUI's test (get_control, both versions): out of range when t[0] > range[0] or t[0] < range[1].
    Reading t[0] waits for the GPU to finish everything queued (t is computed there), which would stall
    every step; for the whole schedule (start 0, end 1, the default) the answer is known without it, as no
    sigma is negative or above 1e9."""
    r = link.timestep_range
    if r is None or (r[0] >= FULL_RANGE_FROM and r[1] <= FULL_RANGE_TO):
        return True
    return not (bool(t[0] > r[0]) or bool(t[0] < r[1]))


def _hint_ready(link, x):
    """True when ComfyUI's get_control would use the link's hint as it is (its own tests): the size matches,
    and the batch does or is 1 (broadcast_image_to returns a batch of 1 unchanged)."""
    h, cr = link.cond_hint, getattr(link, "compression_ratio", 8)
    return (h is not None and x.shape[2] * cr == h.shape[2] and x.shape[3] * cr == h.shape[3]
            and h.shape[0] in (x.shape[0], 1))


def _prepare_hints(top, links, x, t, cond, batched_number, rest, kw):
    """ComfyUI's own get_control over the chain with no-op ControlNet models: only the hints get made."""
    models = [link.control_model for link in links]
    try:
        for link, m in zip(links, models):
            link.control_model = _HintOnly(getattr(m, "dtype", None))
        _stock_call(type(top).get_control, top, x, t, cond, batched_number, rest, kw)
    finally:
        for link, m in zip(links, models):
            link.control_model = m


def _weights_version(link):
    """(version, all on the GPU) of the link's ControlNet weights: the version moves when they change (a
    patch, a reload, a device move), so it is part of the graph key and a graph never replays stale."""
    m = link.control_model
    st = m.__dict__.get(_FP_ATTR)
    if st is None:
        st = m.__dict__[_FP_ATTR] = {"fp": WeightsFingerprint(m), "last": None, "version": 0}
    fp, all_cuda = st["fp"].read(link.__dict__[_MARK][1])
    if fp != st["last"]:
        st["last"], st["version"] = fp, st["version"] + 1
    return st["version"], all_cuda


def _describe(link, weights_version):
    m = link.control_model
    get = lambda name, default=None: getattr(link, name, default)  # noqa: E731 - attributes vary by version
    forward, sampling = m.__dict__.get("forward"), get("model_sampling_current")
    return (type(link).__name__, Token(m), weights_version, forward if forward is None else Token(forward),
            float(link.strength), str(get("strength_type")), bool(get("global_average_pooling", False)),
            str(get("manual_cast_dtype")), sampling if sampling is None else Token(sampling),
            tuple(get("extra_conds", ())), repr(sorted(get("extra_args", {}).items())))
