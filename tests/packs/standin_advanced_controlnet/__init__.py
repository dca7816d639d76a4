"""Test stand-in for Kosinkadink/ComfyUI-Advanced-ControlNet: its ControlNet subclass, timestep keyframes and
soft weights, on ComfyUI's own ControlNet (read in adv_control/control.py, utils.py, nodes_main.py,
nodes_keyframes.py; the 2024 signatures at its 2024-04 commit 33d9884). docs/other_packs.md.

  * Apply converts ComfyUI's ControlNet into the subclass (`ControlNetAdvancedLike.from_vanilla`: the same state,
    a clone of its ModelPatcher), copies it per conditioning and links it to the previous ControlNet;
  * the subclass overrides `get_control` and `control_merge` with instance attributes (bound methods set in
    its init), as Advanced-ControlNet does;
  * every call reads the step on the host (`float(t[0])`), advances its keyframe schedule (Python state kept
    between calls: the last t, the keyframe index, the steps it was used), returns only the previous
    ControlNet's output while its keyframe strength is 0, else runs ComfyUI's forward and scales the raw
    residuals in place by the keyframe strength and the soft weights before ComfyUI's own merge.
Used only by the tests.
"""
import math

import torch

import comfy.controlnet

ControlNet = comfy.controlnet.ControlNet
BIGMAX = torch.tensor(9999999.0)


class TimestepKeyframeLike:
    def __init__(self, start_percent=0.0, strength=1.0, guarantee_steps=1):
        self.start_percent, self.strength, self.guarantee_steps = float(start_percent), strength, guarantee_steps
        self.start_t = 999999999.9

    def effective_guarantee_steps(self, max_sigma):
        return 0 if self.start_t > max_sigma else self.guarantee_steps


class KeyframeGroupLike:
    """Sorted by start_percent; starts with the default keyframe (strength 1 from 0%)."""

    def __init__(self, keyframes=None):
        self.keyframes = list(keyframes) if keyframes else [TimestepKeyframeLike(0.0, 1.0, guarantee_steps=0)]

    def add(self, kf):
        return KeyframeGroupLike(sorted(self.keyframes + [kf], key=lambda k: k.start_percent))


class ControlNetAdvancedLike(ControlNet):
    @classmethod
    def from_vanilla(cls, v, keyframes=None, base_multiplier=1.0):
        new = cls.__new__(cls)
        new.__dict__.update(v.__dict__)
        # Advanced-ControlNet: "needed to avoid breaking memory management system (parent tracking)"
        new.control_model_wrapped = v.control_model_wrapped.clone()
        new._init_advanced(keyframes, base_multiplier)
        return new

    def _init_advanced(self, keyframes, base_multiplier):
        self.sub_idxs = None          # what AnimateDiff's sliding windows look for on a ControlNet
        self.full_latent_length = self.context_length = 0
        self.base_multiplier = base_multiplier
        self.set_timestep_keyframes(keyframes)
        # Advanced-ControlNet's overrides: instance attributes over the class's methods
        self.get_control = self.get_control_inject
        self.control_merge = self.control_merge_inject
        self.pre_run = self.pre_run_inject
        self.cleanup = self.cleanup_inject

    def copy(self):
        c = ControlNet.copy(self)
        new = type(self).__new__(type(self))
        new.__dict__.update(c.__dict__)
        new._init_advanced(self.timestep_keyframes, self.base_multiplier)
        return new

    def set_timestep_keyframes(self, keyframes):
        self.timestep_keyframes = keyframes or KeyframeGroupLike()
        self._reset_schedule()

    def _reset_schedule(self):
        self.t = self.prev_t = None
        self._kf, self._kf_index, self._kf_used_steps = None, -1, 0

    def pre_run_inject(self, model, percent_to_timestep_function):
        ControlNet.pre_run(self, model, percent_to_timestep_function)
        for kf in self.timestep_keyframes.keyframes:
            kf.start_t = percent_to_timestep_function(kf.start_percent)
        self._reset_schedule()

    def cleanup_inject(self):
        ControlNet.cleanup(self)
        self._reset_schedule()

    def prepare_current_timestep(self, t, transformer_options):
        self.t = float(t[0])     # a host sync on every call
        if self.t == self.prev_t:
            return
        max_sigma = torch.max(transformer_options.get("sample_sigmas", BIGMAX))
        kfs = self.timestep_keyframes.keyframes
        if self._kf is None or self._kf_used_steps >= self._kf.effective_guarantee_steps(max_sigma):
            for i in range(self._kf_index + 1, len(kfs)):
                if kfs[i].start_t < self.t:
                    break
                self._kf, self._kf_index, self._kf_used_steps = kfs[i], i, 0
                if kfs[i].effective_guarantee_steps(max_sigma) > 0:
                    break
        self.prev_t = self.t
        self._kf_used_steps += 1

    def get_control_inject(self, x_noisy, t, cond, batched_number, *args):
        # current ComfyUI passes transformer_options; the 2024 one does not
        to = args[0] if args else {}
        self.prepare_current_timestep(t, to)
        if math.isclose(self.strength, 0.0) or math.isclose(self._kf.strength, 0.0):
            if self.previous_controlnet is None:
                return None
            return self.previous_controlnet.get_control(x_noisy, t, cond, batched_number, *args)
        return ControlNet.get_control(self, x_noisy, t, cond, batched_number, *args)

    def control_merge_inject(self, *args, **kwargs):
        """Scales the raw residuals in place (keyframe strength, soft weights), then ComfyUI's own merge:
        (control, control_prev, output_dtype) now, (control_input, control_output, control_prev, output_dtype)
        in the 2024 ComfyUI."""
        raw = args[0] if len(args) + len(kwargs) == 3 else args[1]
        for key, outputs in (raw.items() if isinstance(raw, dict) else [("output", raw)]):
            for i, x in enumerate(outputs):
                if x is not None:
                    if self._kf.strength != 1.0:
                        x[:] *= self._kf.strength
                    x *= self._soft_weight(i, len(outputs), key, isinstance(raw, dict))
        return ControlNet.control_merge(self, *args, **kwargs)

    def _soft_weight(self, i, n, key, keyed):
        """Advanced-ControlNet's universal weights: base_multiplier ** (distance from the middle block)."""
        if key == "middle" or (not keyed and i == n - 1):
            return 1.0
        count = n if keyed else n - 1
        w = [self.base_multiplier ** float(count - j) for j in range(count)]
        return (w[::-1] if key == "input" else w)[i]


class ACNLikeTimestepKeyframe:
    DESCRIPTION = "Test stand-in: a timestep keyframe (strength from start_percent on)."
    CATEGORY = "sdaccel_tests"
    RETURN_TYPES = ("TIMESTEP_KEYFRAME",)
    FUNCTION = "load_keyframe"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0, "step": 0.001}),
            "guarantee_steps": ("INT", {"default": 1, "min": 0, "max": 1000}),
        }, "optional": {"prev_timestep_kf": ("TIMESTEP_KEYFRAME",)}}

    def load_keyframe(self, start_percent, strength, guarantee_steps, prev_timestep_kf=None):
        group = prev_timestep_kf or KeyframeGroupLike()
        return (group.add(TimestepKeyframeLike(start_percent, strength, guarantee_steps)),)


class ACNLikeApply:
    DESCRIPTION = "Test stand-in: Advanced-ControlNet's Apply (converts, keyframes, soft weights)."
    CATEGORY = "sdaccel_tests"
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    FUNCTION = "apply_controlnet"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "positive": ("CONDITIONING",), "negative": ("CONDITIONING",), "control_net": ("CONTROL_NET",),
            "image": ("IMAGE",),
            "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 10.0, "step": 0.01}),
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "base_multiplier": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001}),
        }, "optional": {"timestep_kf": ("TIMESTEP_KEYFRAME",)}}

    def apply_controlnet(self, positive, negative, control_net, image, strength, start_percent, end_percent,
                         base_multiplier, timestep_kf=None):
        hint = image.movedim(-1, 1)
        cnets, out = {}, []
        for conditioning in (positive, negative):
            c = []
            for t in conditioning:
                d = t[1].copy()
                prev = d.get("control", None)
                if prev not in cnets:
                    c_net = _advanced(control_net.copy(), base_multiplier)
                    c_net.set_cond_hint(hint, strength, (start_percent, end_percent))
                    if timestep_kf is not None:
                        c_net.set_timestep_keyframes(timestep_kf)
                    c_net.set_previous_controlnet(prev)
                    cnets[prev] = c_net
                d["control"] = cnets[prev]
                d["control_apply_to_uncond"] = False
                c.append([t[0], d])
            out.append(c)
        return (out[0], out[1])


def _advanced(cn, base_multiplier):
    """Advanced-ControlNet's convert_to_advanced for a plain ComfyUI ControlNet (what the stock loader gives)."""
    if isinstance(cn, ControlNetAdvancedLike):
        cn.base_multiplier = base_multiplier
        return cn
    if type(cn) is ControlNet:
        return ControlNetAdvancedLike.from_vanilla(cn, base_multiplier=base_multiplier)
    return cn


NODE_CLASS_MAPPINGS = {"ACNLikeApply": ACNLikeApply, "ACNLikeTimestepKeyframe": ACNLikeTimestepKeyframe}
NODE_DISPLAY_NAME_MAPPINGS = {"ACNLikeApply": "Advanced-ControlNet-like Apply (test stand-in)",
                              "ACNLikeTimestepKeyframe": "Advanced-ControlNet-like Timestep Keyframe (test stand-in)"}
