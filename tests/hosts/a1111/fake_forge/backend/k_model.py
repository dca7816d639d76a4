"""Stand-in for Forge's `KModel`: the UNet as `diffusion_model` and a predictor module whose sigma buffers
`apply_model` reads; `apply_model(x, t, c_crossattn=, transformer_options=, ...)` -> denoised."""
import torch


class Predictor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("log_sigmas", torch.linspace(-3.0, 2.5, 1000))

    def timestep(self, sigma):
        dists = sigma.log().to(self.log_sigmas.device) - self.log_sigmas[:, None]
        return dists.abs().argmin(dim=0).view(sigma.shape).to(sigma.device)


class KModel(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.diffusion_model = unet
        self.predictor = Predictor()

    def apply_model(self, x, t, c_crossattn=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        sigma = t
        xc = x / (sigma[:, None, None, None] ** 2 + 1) ** 0.5
        out = self.diffusion_model(xc, self.predictor.timestep(t).float(), context=c_crossattn)
        return x - out * sigma[:, None, None, None]
