"""Stand-in for Forge's `backend/patcher/controlnet.py`, as far as SD Accel's Forge host meets it.

* `ControlNet(control_model)`: holds the control model and a ModelPatcher of it (`control_model_wrapped`, a new
  one per `copy()`, as Forge's `apply_controlnet_advanced` copies per generation). `get_control(x, t, cond,
  batched_number)`: the previous ControlNet's control first; the hint resized to 8x the latent (nearest) once and
  cast to the control model's dtype; then the control model called through the transformer option
  `controlnet_model_function_wrapper` when one is set, with x, the hint as prepared (not moved to the device),
  timesteps, context, y, `model=self` and `inner_model=` the control model, and else directly with the hint moved
  to the ControlNet's device; each output scaled by the strength, the previous control added.
* `ControlLora(ControlNet)`: a subclass (Forge builds its control model per run from the UNet's weights and its
  own ops).
* `T2IAdapter(t2i_model)`: calls the option with `hint=` (cast to x's dtype), `model=`, `inner_model=` and
  `inner_t2i_model=`, else `t2i_model(hint.to(x))`.
Written from reading Forge's code (dfdcbab6); not Forge's code.
"""
import torch
import torch.nn.functional as F

from . import ModelPatcher


class ControlBase:
    def __init__(self, device=torch.device("cpu")):
        self.cond_hint_original, self.cond_hint = None, None
        self.strength = 1.0
        self.device = device
        self.previous_controlnet = None
        self.transformer_options = {}

    def set_cond_hint(self, hint, strength=1.0):
        self.cond_hint_original, self.strength = hint, strength
        return self

    def set_previous_controlnet(self, cnet):
        self.previous_controlnet = cnet
        return self

    def _merge(self, outs, prev):
        out = [o * self.strength for o in outs]
        if prev is not None:
            out = [o + p for o, p in zip(out, prev)]
        return out

    def _hook(self):
        return self.transformer_options.get("controlnet_model_function_wrapper")


class ControlNet(ControlBase):
    def __init__(self, control_model, device=torch.device("cpu")):
        super().__init__(device)
        self.control_model = control_model
        self.control_model_wrapped = ModelPatcher(control_model)

    def copy(self):
        c = type(self)(self.control_model, self.device)
        c.cond_hint_original, c.strength = self.cond_hint_original, self.strength
        return c

    def get_control(self, x_noisy, t, cond, batched_number):
        prev = None
        if self.previous_controlnet is not None:
            prev = self.previous_controlnet.get_control(x_noisy, t, cond, batched_number)
        dtype = next(self.control_model.parameters()).dtype
        size = (x_noisy.shape[2] * 8, x_noisy.shape[3] * 8)
        if self.cond_hint is None or tuple(self.cond_hint.shape[2:]) != size:
            self.cond_hint = F.interpolate(self.cond_hint_original, size=size, mode="nearest-exact").to(dtype)
        if x_noisy.shape[0] != self.cond_hint.shape[0]:
            self.cond_hint = self.cond_hint.repeat(x_noisy.shape[0] // self.cond_hint.shape[0], 1, 1, 1)
        context, y = cond["c_crossattn"], cond.get("y")
        timesteps = t.float()
        hook = self._hook()
        if hook is not None:
            outs = hook(x=x_noisy.to(dtype), hint=self.cond_hint, timesteps=timesteps, context=context.to(dtype),
                        y=y, model=self, inner_model=self.control_model)
        else:
            outs = self.control_model(x=x_noisy.to(dtype), hint=self.cond_hint.to(self.device),
                                      timesteps=timesteps, context=context.to(dtype), y=y)
        return self._merge(outs, prev)


class ControlLora(ControlNet):
    pass


class T2IAdapter(ControlBase):
    def __init__(self, t2i_model, device=torch.device("cpu")):
        super().__init__(device)
        self.t2i_model = t2i_model

    def get_control(self, x_noisy, t, cond, batched_number):
        hint = F.interpolate(self.cond_hint_original, size=(x_noisy.shape[2] * 8, x_noisy.shape[3] * 8),
                             mode="nearest-exact").float()
        hook = self._hook()
        if hook is not None:
            outs = hook(hint=hint.to(x_noisy.dtype), model=self, inner_model=self.t2i_model,
                        inner_t2i_model=self.t2i_model)
        else:
            outs = self.t2i_model(hint.to(x_noisy))
        return self._merge(outs, None)
