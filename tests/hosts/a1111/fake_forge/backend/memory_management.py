"""Stand-in for Forge's `backend.memory_management` for one patcher at a time.

`load_models_gpu(patcher)`: a patcher already loaded stays (nothing re-applied); another clone of the same
model loaded before is unloaded first (its object patches taken out, the weights left where they are);
then the new one is loaded: object patches put in, the model moved to its load device, and with
`lowvram=True` every module that has `parameters_manual_cast` set to cast per call (Forge's CPU swap; the
others, "legacy" modules, are loaded whole); then its LoRAs refreshed.
`unload_all()`: the loaded patcher unloaded to its offload device.
"""
loaded = []


def _unload(patcher, move):
    for m in patcher.model.modules():
        if "prev_parameters_manual_cast" in m.__dict__:
            m.parameters_manual_cast = m.__dict__.pop("prev_parameters_manual_cast")
    patcher.forge_unpatch_model(patcher.offload_device if move else None)


def load_models_gpu(patcher, lowvram=False):
    if any(p is patcher for p in loaded):
        return
    for p in [p for p in loaded if patcher.is_clone(p)]:
        loaded.remove(p)
        _unload(p, move=False)
    model = patcher.forge_patch_model(patcher.load_device)
    if lowvram:
        for m in model.modules():
            if hasattr(m, "parameters_manual_cast"):
                m.prev_parameters_manual_cast = m.parameters_manual_cast
                m.parameters_manual_cast = True
    patcher.refresh_loras()
    loaded.append(patcher)


def unload_all():
    while loaded:
        _unload(loaded.pop(), move=True)
