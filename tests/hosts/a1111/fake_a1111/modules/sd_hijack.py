"""Stand-in for the part of A1111's `modules.sd_hijack` that extensions use for the UNet: the stock
`UNetModel.forward` is kept as `ldm_original_forward` and the class forward is replaced by
`sd_unet.create_unet_forward` (`hijack_unet_forward`/`undo_unet_forward`, called by the tests; A1111
does it at import)."""
from . import sd_unet

ldm_original_forward = None
sgm_original_forward = None


def hijack_unet_forward(unet_class):
    global ldm_original_forward
    ldm_original_forward = unet_class.forward
    unet_class.forward = sd_unet.create_unet_forward(ldm_original_forward)


def undo_unet_forward(unet_class):
    global ldm_original_forward
    if ldm_original_forward is not None:
        unet_class.forward = ldm_original_forward
        ldm_original_forward = None
