"""Stand-in for Forge's ResBlock (backend/nn/unet.py), as far as SD Accel's ResBlock stand-in meets it: Forge's
blocks call it as `block(x, emb, transformer_options)`, its `_forward` takes the options too, and with a
`group_norm_wrapper` in them it hands each of its two GroupNorms (with their input) to the wrapper and runs
the rest of that Sequential after it. Otherwise it computes what ldm's ResBlock computes. Built on ldm's
ResBlock (its children and parameters), written from reading Forge's; not Forge's code."""
from ldm.modules.diffusionmodules import openaimodel


class ResBlock(openaimodel.ResBlock):
    def forward(self, x, emb, transformer_options={}):  # noqa: B006 - Forge's signature
        return self._forward(x, emb, transformer_options)

    def _forward(self, x, emb, transformer_options={}):  # noqa: B006
        # the plain case only (no up/down sampling, no scale-shift norm): the stand-in is planned for no other
        assert not self.updown and not self.use_scale_shift_norm
        wrap = transformer_options.get("group_norm_wrapper")
        if wrap is None:
            h = self.in_layers(x)
        else:
            h = self.in_layers[1:](wrap(self.in_layers[0], x, transformer_options))
        emb_out = self.emb_layers(emb).type(h.dtype)
        while len(emb_out.shape) < len(h.shape):
            emb_out = emb_out[..., None]
        h = h + emb_out
        if wrap is None:
            h = self.out_layers(h)
        else:
            h = self.out_layers[1:](wrap(self.out_layers[0], h, transformer_options))
        return self.skip_connection(x) + h


def forge_shaped(block):
    """`block` (an ldm ResBlock) as Forge's class."""
    block.__class__ = ResBlock
    return block
