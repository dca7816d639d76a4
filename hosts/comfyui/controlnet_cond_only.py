"""ControlNet on the cond rows only, an opt-in LOSSY mode of Accelerated KSampler's ControlNet copies.

Off by default (`ControlNetOptions.cond_only`). ComfyUI runs cond and uncond in one
batch when both carry the same control object, and `ControlNet.get_control` runs the ControlNet on the
whole batch. With this option our copy gets an instance attribute `get_control` (the class's own method
is not touched; `del copy.get_control` undoes it) that reads `transformer_options["cond_or_uncond"]`,
calls the class's get_control on the cond rows only (x, t and the per-row conds sliced, the hint
broadcast to those rows by ComfyUI's own code) and gives the uncond rows zero residuals, i.e. nothing
added: half the ControlNet work under CFG, and a different image (the negative prediction no longer sees
the control). Rows decide, not the list a control came from: a batch of uncond rows only (a negative with
its own control object) gets no control at all. Previous links of the chain run inside that call, so on
the cond rows as well. Where ComfyUI does not say which rows are cond (2024's get_control has no
transformer_options) the full batch runs, lossless, and the report says so. A half batch is another
input shape, so with CUDA graphs on it simply gets its own graph.
"""
import types

COND, UNCOND = 0, 1   # comfy.samplers' labels in cond_or_uncond


def set_cond_only(cn, stats, depth=None):
    """Cond-only mode on `cn`, a copy of ours (never a ControlNet the user's graph holds): an instance
    attribute over the class's get_control. `del cn.get_control` removes it. `stats` counts the calls
    (the links of one chain share it and `depth`, so a chain's call counts once)."""
    cn._sdaccel_cond_only = (stats, depth if depth is not None else [0])
    cn.get_control = types.MethodType(_cond_only_get_control, cn)


def _cond_spans(batch, cond_or_uncond):
    """(row spans of the cond chunks, number of cond chunks, number of chunks), or None when unknown."""
    if not isinstance(cond_or_uncond, (list, tuple)) or not cond_or_uncond or batch % len(cond_or_uncond):
        return None
    per = batch // len(cond_or_uncond)
    spans = []
    for i, label in enumerate(cond_or_uncond):
        if label != COND:
            continue
        if spans and spans[-1][1] == i * per:
            spans[-1] = (spans[-1][0], (i + 1) * per)
        else:
            spans.append((i * per, (i + 1) * per))
    return spans, sum(1 for v in cond_or_uncond if v == COND), len(cond_or_uncond)


def _take_rows(v, spans, batch):
    import torch
    if not isinstance(v, torch.Tensor) or v.ndim == 0 or v.shape[0] != batch:
        return v
    if len(spans) == 1:
        return v[spans[0][0]:spans[0][1]]
    return torch.cat([v[a:b] for a, b in spans])


def _pad_rows(control, spans, batch):
    """The residuals of the cond rows back at their rows of the full batch; zeros on the uncond rows."""
    import torch
    n = sum(b - a for a, b in spans)
    padded = {}   # id -> padded tensor: a tensor shared between entries stays shared

    def pad(x):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != n:
            return x
        hit = padded.get(id(x))
        if hit is None:
            hit = x.new_zeros((batch,) + tuple(x.shape[1:]))
            o = 0
            for a, b in spans:
                hit[a:b] = x[o:o + b - a]
                o += b - a
            padded[id(x)] = hit
        return hit
    return {k: [pad(x) for x in v] if isinstance(v, list) else v for k, v in control.items()}


def _cond_only_get_control(self, x_noisy, t, cond, batched_number, *args, **kwargs):
    stats, depth = self._sdaccel_cond_only
    depth[0] += 1
    try:
        return _cond_only(self, stats, depth[0] == 1, x_noisy, t, cond, batched_number, *args, **kwargs)
    finally:
        depth[0] -= 1


def _cond_only(self, stats, outermost, x_noisy, t, cond, batched_number, *args, **kwargs):
    stock = type(self).get_control
    to = args[0] if args else kwargs.get("transformer_options", cond.get("transformer_options"))
    rows = _cond_spans(x_noisy.shape[0], (to or {}).get("cond_or_uncond"))
    if rows is None:
        stats["no_info"] += outermost
        return stock(self, x_noisy, t, cond, batched_number, *args, **kwargs)
    spans, n_cond, n_chunks = rows
    if n_cond == n_chunks:
        return stock(self, x_noisy, t, cond, batched_number, *args, **kwargs)
    if n_cond == 0:
        stats["uncond_skipped"] += 1
        return None
    stats["halved"] += 1
    batch = x_noisy.shape[0]
    to2 = dict(to, cond_or_uncond=[COND] * n_cond)
    uuids = to.get("uuids")
    if isinstance(uuids, (list, tuple)) and len(uuids) == n_chunks:
        to2["uuids"] = [u for u, label in zip(uuids, to["cond_or_uncond"]) if label == COND]
    cond2 = {k: _take_rows(v, spans, batch) for k, v in cond.items()}
    if "transformer_options" in cond2:
        cond2["transformer_options"] = to2
    if args:
        args = (to2,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, transformer_options=to2)
    out = stock(self, _take_rows(x_noisy, spans, batch), _take_rows(t, spans, batch), cond2, n_cond, *args, **kwargs)
    return None if out is None else _pad_rows(out, spans, batch)
