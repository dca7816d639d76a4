"""A graph's memory given back when current ComfyUI unloads the model it was captured for (ON_DETACH), and the
layout of a stand-in's conv weights put back with it."""
import weakref

from ...engine.graphs import graph_memory
from ...engine.graphs.graphed_forward import GraphedForward


def calls_on_detach(patcher):
    """Whether this ComfyUI calls ON_DETACH callbacks (0.3.x): its word for when it unloads a model."""
    return hasattr(patcher, "add_callback_with_key")


def no_detach_reason(patcher, what):
    """Why no call of `what` (a model's name for the message) may keep a graph on this ComfyUI, or None: a graph's
    memory must go when ComfyUI unloads the model to make room for another, and only ON_DETACH says when."""
    if calls_on_detach(patcher):
        return None
    return ("this ComfyUI has no ON_DETACH callbacks: a graph's memory would stay reserved after ComfyUI unloads the "
            "%s (update ComfyUI to 0.3.x)" % what)


def free_graphs_on_unload(patcher, patches):
    """Current ComfyUI: when it detaches `patcher` (it loads another clone of the model, the user's own in a stock
    node, or unloads it), the conv weights of the GraphedForwards among `patches` go back to stock's layout, and
    once the weights have left the GPU their graph memory is freed and given back to the device (older ComfyUI
    has no callbacks: the graphs go when the weights change or the model dies). Returns whether this ComfyUI calls
    ON_DETACH callbacks (False: the caller puts the layout back itself)."""
    forwards = [gf for gf in patches.values() if isinstance(gf, GraphedForward)]
    if not calls_on_detach(patcher):
        return False
    if not forwards:
        return True
    import comfy.patcher_extension as pe
    # A stand-in is one per module and options, shared by every clone made for it (a ControlNet gets a new clone
    # per run): the layout is for the newest clone to put back. An older clone's patcher freed later, in the
    # middle of another run, detaches too (ModelPatcher.__del__); putting the weights back then made the running
    # clone's graphs replay over the other layout
    owner = weakref.ref(patcher)
    for gf in forwards:
        gf.layout_owner = owner

    def on_detach(p, unpatch_all=True, _forwards=tuple(forwards)):
        held = [gf for gf in _forwards if gf.graphs.entries]
        for gf in _forwards:
            gf.graphs.clear_if_offloaded()
            if gf.layout_owner() is p:
                gf.to_stock_layout()
        if held and not any(gf.graphs.entries for gf in held):
            # under cudaMallocAsync the freed graphs' memory stays the driver's until trimmed, and ComfyUI
            # unloaded this model to have that memory
            graph_memory.trim(getattr(p, "load_device", None))
    patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, "sd_accel", on_detach)
    return True
