"""ComfyUI's weight casting as SD Accel's fused modules see it.

`register()` hands the engine comfy.ops' `cast_bias_weight` (what low-VRAM and manual-cast modules compute their
weights with) and the ops forwards that cast and then compute the plain op, for which a fused module may stand in;
another ops class's forward (fp8_ops in FP8, scaled fp8, a pack's) computes otherwise and keeps its layers' own.
"""
import logging

from ...engine.patches import fused_modules, shared_state

log = logging.getLogger("sd_accel")


def register():
    """Hands the engine ComfyUI's weight casting (called before each plan: idempotent)."""
    # ComfyUI marks a module whose weights it patched and skips it at the next load; a stand-in shares its module's
    # weights, so it shares that mark too
    shared_state.share(("comfy_patched_weights",))
    try:
        import comfy.ops
        fused_modules.set_host_weight_caster(comfy.ops.cast_bias_weight)
        fused_modules.set_plain_cast_forwards(_plain_cast_forwards(comfy.ops), _plain_in_training(comfy.ops))
    except Exception as e:  # noqa: BLE001 - an old host without cast_bias_weight: plain weights only
        log.info("[SD Accel] comfy.ops.cast_bias_weight unavailable (%s); low-VRAM casting off", e)


def _plain_cast_forwards(ops):
    """ComfyUI's own cast-then-compute forwards: its disable_weight_init classes' (manual_cast's inherit them).
    Another ops class's (fp8_ops, scaled fp8, a pack's) computes otherwise and keeps its layers' forwards."""
    classes = [c for c in vars(ops.disable_weight_init).values() if isinstance(c, type)]
    return [c.__dict__["forward_comfy_cast_weights"] for c in classes if "forward_comfy_cast_weights" in c.__dict__]


def _plain_in_training(ops):
    """fp8_ops' Linear forward (UNETLoader's fp8_e4m3fn_fast) where it multiplies in FP8 only `if not self.training`
    and otherwise casts and calls F.linear, as current ComfyUI's does: the plain op while the UNet is in training
    mode, which ComfyUI leaves it in. Read from its source; any other body is not registered (its layers keep their
    own forward)."""
    cls = getattr(getattr(ops, "fp8_ops", None), "Linear", None)
    src = fused_modules.host_source(cls, "forward_comfy_cast_weights", ("self", "input")) if cls else None
    body = ("if not self.training:", "weight, bias = cast_bias_weight(self, input)",
            "return torch.nn.functional.linear(input, weight, bias)")
    if src and all(line in src for line in body) and src.count("return") == 2:
        return [cls.__dict__["forward_comfy_cast_weights"]]
    return []
