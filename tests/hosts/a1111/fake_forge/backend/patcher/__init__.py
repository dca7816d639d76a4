"""Stand-in for Forge's `backend.patcher` (base.ModelPatcher, unet.UnetPatcher, lora.LoraLoader).

* `clone()`: a new patcher of the same model; object patches and LoRA patches copied shallow, model_options
  deep-copied (functions keep their identity).
* object patches are data until the memory manager loads the patcher (`forge_patch_model`: each path set in
  the model, the first original kept) and put back by path when it unloads it (`forge_unpatch_model`).
* `set_model_unet_function_wrapper`: the one `model_function_wrapper` slot (a later call replaces it).
* `set_model_output_block_patch`: appended to the transformer options' `patches` (a new list each time).
* `UnetPatcher`: ControlNets as a linked list (`add_patched_controlnet`, the list shared by clones), and the
  one `controlnet_model_function_wrapper` transformer option (`set_controlnet_model_function_wrapper`).
* LoRA: `add_patches(filename=, patches={model key: ("diff", (delta,))}, strength_patch=, online_mode=)`
  records the patches of the model's keys under (filename, strength_patch, strength_model, online_mode);
  `refresh_loras()` (called by the memory manager after `forge_patch_model`) does nothing while the LoRA set
  is the one loaded; else it puts the backed-up Parameters back and sets a NEW Parameter (weight + delta) on
  whichever module stands at each key's path, or, online, sets `forge_online_loras` on it. The loader is the
  model's own (`model.lora_loader`), shared by every clone.
"""
import copy

import torch

from .. import utils


class LoraLoader:
    def __init__(self, model):
        self.model = model
        self.backup = {}
        self.online = []
        self.loaded_hash = str([])

    @torch.no_grad()
    def refresh(self, lora_patches):
        hashes = str(list(lora_patches.keys()))
        if hashes == self.loaded_hash:
            return
        for m in set(self.online):
            del m.forge_online_loras
        self.online = []
        for key, w in self.backup.items():
            utils.set_attr_raw(self.model, key, w)
        self.backup = {}
        for (_, strength, _, online), patches in lora_patches.items():
            for key, (kind, (delta,)) in patches.items():
                parent_path, _, name = key.rpartition(".")
                parent = utils.get_attr(self.model, parent_path)
                if online:
                    parent.__dict__.setdefault("forge_online_loras", {}).setdefault(name, []).append(strength * delta)
                    self.online.append(parent)
                    continue
                weight = getattr(parent, name)
                self.backup.setdefault(key, weight)
                utils.set_attr_raw(self.model, key, torch.nn.Parameter(weight + strength * delta.to(weight),
                                                                        requires_grad=False))
        self.loaded_hash = hashes


class ModelPatcher:
    def __init__(self, model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")):
        self.model = model
        self.load_device, self.offload_device = load_device, offload_device
        self.object_patches, self.object_patches_backup = {}, {}
        self.lora_patches = {}
        self.model_options = {"transformer_options": {}}
        if not hasattr(model, "lora_loader"):
            model.lora_loader = LoraLoader(model)

    def clone(self):
        n = type(self)(self.model, self.load_device, self.offload_device)
        n.object_patches = self.object_patches.copy()
        n.lora_patches = self.lora_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        return n

    def is_clone(self, other):
        return getattr(other, "model", None) is self.model

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def set_model_unet_function_wrapper(self, fn):
        self.model_options["model_function_wrapper"] = fn

    def set_model_output_block_patch(self, patch):
        to = self.model_options["transformer_options"]
        to.setdefault("patches", {})
        to["patches"]["output_block_patch"] = to["patches"].get("output_block_patch", []) + [patch]

    def add_patches(self, *, filename, patches, strength_patch=1.0, strength_model=1.0, online_mode=False):
        keys = {k for k, _ in self.model.named_parameters()}
        mine = {k: v for k, v in patches.items() if k in keys and v[0] == "diff"}
        self.lora_patches[(filename, strength_patch, strength_model, online_mode)] = mine
        return set(mine)

    def has_online_lora(self):
        return any(ident[3] for ident in self.lora_patches)

    def refresh_loras(self):
        self.model.lora_loader.refresh(self.lora_patches)

    def forge_patch_model(self, target_device=None):
        for k, item in self.object_patches.items():
            old = utils.get_attr(self.model, k)
            self.object_patches_backup.setdefault(k, old)
            utils.set_attr_raw(self.model, k, item)
        if target_device is not None:
            self.model.to(target_device)
        return self.model

    def forge_unpatch_model(self, target_device=None):
        if target_device is not None:
            self.model.to(target_device)
        for k, v in self.object_patches_backup.items():
            utils.set_attr_raw(self.model, k, v)
        self.object_patches_backup = {}


class UnetPatcher(ModelPatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.controlnet_linked_list = None

    def clone(self):
        n = super().clone()
        n.controlnet_linked_list = self.controlnet_linked_list
        return n

    def set_group_norm_wrapper(self, wrapper):
        self.model_options["transformer_options"]["group_norm_wrapper"] = wrapper

    def add_patched_controlnet(self, cnet):
        cnet.set_previous_controlnet(self.controlnet_linked_list)
        self.controlnet_linked_list = cnet

    def set_controlnet_model_function_wrapper(self, wrapper):
        self.model_options["transformer_options"]["controlnet_model_function_wrapper"] = wrapper
