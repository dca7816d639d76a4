"""Stand-in for A1111's `modules.sd_unet`: `SdUnetOption`/`SdUnet`, `list_unets` from the
`on_list_unets` callbacks, `apply_unet` with "Automatic" (the option whose `model_name` is the loaded
checkpoint's), "None", or a label; the stock UNet goes to the CPU while a replacement is active; the
UNet class forward routes to the active replacement (`create_unet_forward`)."""
import torch

from . import script_callbacks, shared

unet_options = []
current_unet_option = None
current_unet = None


def _sd_model():
    from . import sd_models
    return sd_models.model_data.sd_model


def list_unets():
    unet_options.clear()
    unet_options.extend(script_callbacks.list_unets_callback())


def get_unet_option(option=None):
    option = option or getattr(shared.opts, "sd_unet", "Automatic")
    if option == "None":
        return None
    if option == "Automatic":
        name = _sd_model().sd_checkpoint_info.model_name
        found = [x for x in unet_options if x.model_name == name]
        option = found[0].label if found else "None"
    return next(iter([x for x in unet_options if x.label == option]), None)


def apply_unet(option=None):
    global current_unet_option, current_unet
    new_option = get_unet_option(option)
    if new_option == current_unet_option:
        return
    if current_unet is not None:
        current_unet.deactivate()
    current_unet_option = new_option
    if new_option is None:
        current_unet = None
        _sd_model().model.diffusion_model.to(shared.device)
        return
    _sd_model().model.diffusion_model.to("cpu")
    current_unet = new_option.create_unet()
    current_unet.option = new_option
    current_unet.activate()


class SdUnetOption:
    model_name = None
    label = None

    def create_unet(self):
        raise NotImplementedError()


class SdUnet(torch.nn.Module):
    def forward(self, x, timesteps, context, *args, **kwargs):
        raise NotImplementedError()

    def activate(self):
        pass

    def deactivate(self):
        pass


def create_unet_forward(original_forward):
    def UNetModel_forward(self, x, timesteps=None, context=None, *args, **kwargs):
        if current_unet is not None:
            return current_unet.forward(x, timesteps, context, *args, **kwargs)
        return original_forward(self, x, timesteps, context, *args, **kwargs)
    return UNetModel_forward
