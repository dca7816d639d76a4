"""sd-webui-freeu's hook on the UNet's skip concatenation (see the package doc)."""
import functools

import torch

from . import global_state


def patch():
    """Installs the hook, as the extension does once at load; returns a function that takes it out again."""
    from modules.sd_hijack_unet import th
    th.cat = functools.partial(free_u_cat_hijack, original_function=th.cat)
    return lambda: vars(th).pop("cat", None)


def _scheduled():
    state = global_state.instance
    stop = state.stop_step if state.stop_step is not None else float("inf")
    return state.start_step <= global_state.sampling_step < stop


def free_u_cat_hijack(hs, *args, original_function, **kwargs):
    if not global_state.instance.enable:
        return original_function(hs, *args, **kwargs)
    if not _scheduled() or len(hs) != 2 or kwargs.get("dim") != 1:
        return original_function(hs, *args, **kwargs)
    h, h_skip = hs
    stage = global_state.instance.stages.get(h.shape[1])
    if stage is not None:
        backbone, skip = stage
        h = h.clone()
        h[:, : h.shape[1] // 2] *= backbone
        h_skip = _low_frequencies_scaled(h_skip, skip)
    return original_function([h, h_skip], *args, **kwargs)


def _low_frequencies_scaled(x, scale):
    spectrum = torch.fft.fftshift(torch.fft.fft2(x.float()), dim=(-2, -1))
    row, col = x.shape[-2] // 2, x.shape[-1] // 2
    spectrum[..., row - 1:row + 1, col - 1:col + 1] *= scale
    return torch.fft.ifft2(torch.fft.ifftshift(spectrum, dim=(-2, -1))).real.to(x.dtype)
