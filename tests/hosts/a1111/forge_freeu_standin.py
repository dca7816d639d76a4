"""Stand-in of Forge's built-in FreeU (lllyasviel/stable-diffusion-webui-forge, dfdcbab6,
`extensions-builtin/sd_forge_freeu/scripts/forge_freeu.py`), its mechanism reproduced, not its code.

The extension's Script class keeps `doFreeU` as a class attribute. Before every step a denoiser callback sets it
from the user's start/end schedule (`sampling_step / (total_sampling_steps - 1)` inside [start, end]). The patch
it sets on the UNet patcher (`set_model_output_block_patch`, a closure over the scales keyed by channel count)
reads that class attribute on every call: while it is False the skip and backbone features pass unchanged.
So what a call computes depends on a flag that is neither in its arguments nor in its closure. The skip filter
is the extension's own function, in its own module, computing what ComfyUI's `Fourier_filter` does.
"""
import torch


class FreeUScript:
    doFreeU = True          # a class attribute, as the extension's: read by the patch, set by the callback
    start, end = 0.0, 1.0

    @classmethod
    def denoiser_callback(cls, sampling_step, total_sampling_steps):
        at = sampling_step / (total_sampling_steps - 1)
        cls.doFreeU = cls.start <= at <= cls.end


def Fourier_filter(x, threshold, scale):  # noqa: N802 - the name the extension gives its own copy of the filter
    """FreeU's skip filter, as the extension carries it in its own module: the centred window of the fp32 spectrum
    `2 * threshold` modes wide scaled by `scale`."""
    planes = torch.fft.fftn(x.float(), dim=(-2, -1))
    planes = torch.fft.fftshift(planes, dim=(-2, -1))
    rows, cols = planes.shape[-2] // 2, planes.shape[-1] // 2
    window = (slice(rows - threshold, rows + threshold), slice(cols - threshold, cols + threshold))
    planes[(Ellipsis,) + window] = planes[(Ellipsis,) + window] * scale
    planes = torch.fft.ifftshift(planes, dim=(-2, -1))
    return torch.fft.ifftn(planes, dim=(-2, -1)).real.to(x.dtype)


def make_output_block_patch(model_channels, b1, b2, s1, s2):
    scales = {model_channels * 4: (b1, s1), model_channels * 2: (b2, s2)}

    def output_block_patch(h, hsp, transformer_options):
        if FreeUScript.doFreeU:
            scale = scales.get(h.shape[1])
            if scale is not None:
                mean = h.mean(1, keepdim=True)
                lo = mean.amin(dim=(2, 3), keepdim=True)
                hi = mean.amax(dim=(2, 3), keepdim=True)
                mean = (mean - lo) / (hi - lo)
                half = h.shape[1] // 2
                h[:, :half] = h[:, :half] * ((scale[0] - 1) * mean + 1)
                hsp = Fourier_filter(hsp, threshold=1, scale=scale[1])
        return h, hsp
    return output_block_patch


def patch_freeu_v2(unet_patcher, b1, b2, s1, s2):
    """A clone of the patcher with the patch set, as the extension's `process_before_every_sampling` does (the
    model's channel count read where ComfyUI keeps it: Forge's patcher keeps it on the diffusion model's config)."""
    channels = unet_patcher.model.model_config.unet_config["model_channels"]
    m = unet_patcher.clone()
    m.set_model_output_block_patch(make_output_block_patch(channels, b1, b2, s1, s2))
    return m
