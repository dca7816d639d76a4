"""Which diffusion models SD Accel plans for: ComfyUI's UNetModel (SD1.x, SD2.x, SDXL and their inpainting, refiner
and video relatives), whose modules and step the engine's stand-ins, graphs and tests are made for, and whose
blocks the VRAM Pool's lowvram streaming cuts into units. Another family (Flux, SD3's MMDiT and the other DiTs) is
left to ComfyUI as it is, with one line saying so: its modules would be matched by type alone (a DiT's LayerNorms)
and its step captured untested."""


def unsupported_reason(patcher):
    """None for an SD UNet (or where this ComfyUI cannot tell), else the one-line reason."""
    dm = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    try:
        from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    except ImportError:
        return None
    if dm is None or isinstance(dm, UNetModel):
        return None
    return ("the diffusion model is a %s, not an SD UNet (SD1.x, SD2.x, SDXL): SD Accel leaves it to ComfyUI"
            % type(dm).__name__)
