"""ControlNet Union's control-type embedding, capturable: the host's own forward, handed the types as a GPU index.

ComfyUI's ControlAddEmbedding (cldm.py) sets its one-hot with `c_type[control_type] = 1.0`, indexing a GPU tensor
with a Python list: a copy of the index from host memory at every call, which no CUDA graph can hold. The probe
refused such a step ("waits for the GPU inside the step (cldm.py)"), and as a ControlNet runs inside the UNet's
step, every step of a graph with a union ControlNet ran eagerly. The stand-in passes the same types as an index
tensor on the model's device, made on a call outside any capture (a key's first call is its eager warm-up, and the
types are part of the key) and kept: the same one-hot, the same values.
"""
import torch

from ...engine.patches import fused_modules as fm

ATTR = "control_add_embedding"


class ControlTypeOnDevice:
    sdaccel_kind = "control_type_index"

    def forward(self, control_type, dtype, device):
        if isinstance(control_type, (list, tuple)) and control_type:
            key = (tuple(int(c) for c in control_type), str(device))
            kept = self.__dict__.setdefault("_sdaccel_index", {})
            index = kept.get(key)
            if index is None and not _capturing(device):
                index = kept[key] = torch.tensor(key[0], dtype=torch.long, device=device)
            if index is not None:
                control_type = index
        return fm.original_class(self).forward(self, control_type, dtype, device)


def _capturing(device):
    return getattr(device, "type", None) == "cuda" and torch.cuda.is_current_stream_capturing()


def plan(control_model):
    """{ATTR: stand-in} for a union ControlNet's type embedding; {} for any other ControlNet. One stand-in per
    embedding, kept on the model: a ControlNet's patcher is a new clone every prompt, and a new stand-in would be a
    new module in the graph key, so no later prompt would replay."""
    embedding = getattr(control_model, ATTR, None)
    if embedding is None or not callable(getattr(embedding, "forward", None)):
        return {}
    if fm.kind_of(embedding) == ControlTypeOnDevice.sdaccel_kind:
        return {ATTR: embedding}          # another clone's stand-in, still applied
    kept = control_model.__dict__.get(_KEPT)
    if kept is None or kept[0] is not embedding:
        kept = control_model.__dict__[_KEPT] = (embedding, fm.clone_as(ControlTypeOnDevice, embedding))
    return {ATTR: kept[1]}


_KEPT = "_sdaccel_control_type_index"     # (the embedding, its stand-in)
