"""ControlNet Union's control-type embedding, capturable: the host's own forward, handed the type as a slice.

ComfyUI's ControlAddEmbedding (cldm.py) sets its one-hot with `c_type[control_type] = 1.0`, indexing a GPU tensor
with a Python list: advanced indexing, which copies the index and the value from host memory at every call, and no
CUDA graph can hold that (a long index already on the GPU still waits: tried on an H100). The probe refused such a
step ("waits for the GPU inside the step (cldm.py)"), and as a ControlNet runs inside the UNet's step, every step of
a graph with a union ControlNet ran eagerly. SetUnionControlNetType sets one type; for one type the stand-in hands
the host's own forward `slice(k, k + 1)`: basic indexing, a fill on the GPU, the same one-hot. Several types (other
packs' nodes) keep the list, and those steps run eagerly as before.
"""
from ...engine.patches import fused_modules as fm

ATTR = "control_add_embedding"


class ControlTypeAsSlice:
    sdaccel_kind = "control_type_slice"

    def forward(self, control_type, dtype, device):
        if isinstance(control_type, (list, tuple)) and len(control_type) == 1:
            k = int(control_type[0])
            if 0 <= k < self.num_control_type:     # else the host's own indexing raises, as on stock
                control_type = slice(k, k + 1)
        return fm.original_class(self).forward(self, control_type, dtype, device)


def plan(control_model):
    """{ATTR: stand-in} for a union ControlNet's type embedding; {} for any other ControlNet. One stand-in per
    embedding, kept on the model: a ControlNet's patcher is a new clone every prompt, and a new stand-in would be a
    new module in the graph key, so no later prompt would replay."""
    embedding = getattr(control_model, ATTR, None)
    if embedding is None or not callable(getattr(embedding, "forward", None)):
        return {}
    if fm.kind_of(embedding) == ControlTypeAsSlice.sdaccel_kind:
        return {ATTR: embedding}          # another clone's stand-in, still applied
    kept = control_model.__dict__.get(_KEPT)
    if kept is None or kept[0] is not embedding:
        kept = control_model.__dict__[_KEPT] = (embedding, fm.clone_as(ControlTypeAsSlice, embedding))
    return {ATTR: kept[1]}


_KEPT = "_sdaccel_control_type_slice"     # (the embedding, its stand-in)
