"""Stand-in for A1111's `modules.sd_hijack_unet.th`: the torch A1111 gives the UNet's forward (its
`apply_optimizations` sets it as `th` of ldm's and sgm's openaimodel modules). Every attribute is torch's but
`cat`, which first resizes the first of two tensors to the second's height and width (nearest), so that image
sides that are multiples of 8 but not of 64 concatenate at the skip connections. Extensions hook the UNet there
by setting their own `cat` on this object (sd-webui-freeu)."""
import torch


class TorchProxyForUnet:
    def __getattr__(self, name):
        if name == "cat":
            return self.cat
        return getattr(torch, name)

    def cat(self, tensors, *args, **kwargs):
        if len(tensors) == 2 and tensors[0].shape[-2:] != tensors[1].shape[-2:]:
            tensors = (torch.nn.functional.interpolate(tensors[0], tensors[1].shape[-2:], mode="nearest"), tensors[1])
        return torch.cat(tensors, *args, **kwargs)


th = TorchProxyForUnet()
