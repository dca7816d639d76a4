"""Stand-in of Kohya Hires.fix's block wrapper (wcde/sd-webui-kohya-hiresfix): the features rescaled (bicubic) before
the wrapped block. The extension's callback before each step puts one around an input block (downscaling) and one
around the matching output block (upscaling), changes their `scale` on every step with "smooth scaling", and takes
them out after its last scaled step; A1111's UNet torch proxy resizes the skips the smaller features meet."""
import torch


class Scaler(torch.nn.Module):
    def __init__(self, scale, block):
        super().__init__()
        self.scale, self.block = scale, block

    def forward(self, x, *args):
        return self.block(torch.nn.functional.interpolate(x, scale_factor=self.scale, mode="bicubic"), *args)
