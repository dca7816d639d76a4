"""Stand-in for Forge's control model (`backend/nn/cnets/cldm.py`'s `ControlNet`): the UNet's time embedding,
input blocks and middle block (here ldm's, built with Forge's operations as the stand-in UNet is), a hint encoder
to the latent's size, and a 1x1 conv after every input block and after the middle block. `forward(x, hint,
timesteps, context, y=None)` as Forge's: the hint's features added after the first input block, one output per
input block and one for the middle block. Written from reading Forge's code; not Forge's code."""
import torch
from torch import nn
from ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential
from ldm.modules.diffusionmodules.util import timestep_embedding

from . import operations


def _conv(c_in, c_out, k=3, stride=1):
    return nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2)


class ControlModel(nn.Module):
    def __init__(self, unet, hint_channels=3):
        super().__init__()
        self.model_channels = unet.model_channels
        self.time_embed = unet.time_embed
        self.input_blocks = unet.input_blocks
        self.middle_block = unet.middle_block
        with operations.using_forge_operations():
            c = self.model_channels
            self.input_hint_block = TimestepEmbedSequential(
                _conv(hint_channels, 8), nn.SiLU(), _conv(8, 8, stride=2), nn.SiLU(), _conv(8, 16, stride=2), nn.SiLU(),
                _conv(16, c, stride=2))
            outs = [_block_channels(b, c) for b in self.input_blocks]
            self.zero_convs = nn.ModuleList(TimestepEmbedSequential(_conv(o, o, 1)) for o in outs)
            self.middle_block_out = TimestepEmbedSequential(_conv(outs[-1], outs[-1], 1))

    def forward(self, x, hint, timesteps, context, y=None, **kwargs):
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, repeat_only=False).to(x.dtype))
        guided_hint = self.input_hint_block(hint, emb, context)
        outs, h = [], x
        for module, zero_conv in zip(self.input_blocks, self.zero_convs):
            h = module(h, emb, context)
            if guided_hint is not None:
                h += guided_hint
                guided_hint = None
            outs.append(zero_conv(h, emb, context))
        h = self.middle_block(h, emb, context)
        outs.append(self.middle_block_out(h, emb, context))
        return outs


def _block_channels(block, default):
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    return convs[-1].out_channels if convs else default


class T2IModel(nn.Module):
    """A T2I adapter's model: the hint to a list of feature maps (its only call is `model(hint)`)."""

    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, stride=8, padding=1)

    def forward(self, hint):
        return [self.conv(hint)]
