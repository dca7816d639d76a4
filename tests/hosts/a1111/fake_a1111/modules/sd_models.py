"""Stand-in for A1111's `modules.sd_models` loading paths that matter to extensions:
`load_model` (a new model object, then the model-loaded callbacks), `reload_model_weights` for a
checkpoint of the same config (sd_unet route off, `load_state_dict(strict=False)` into the SAME
object, callbacks again, sd_unet route re-applied), and `reload_vae` (callbacks again, nothing
else changed). `model_data.sd_model` is the loaded model, as in A1111."""
from . import script_callbacks, sd_unet


class _ModelData:
    sd_model = None


model_data = _ModelData()
last_load_result = None


def load_model(sd_model):
    model_data.sd_model = sd_model
    script_callbacks.model_loaded_callback(sd_model)
    return sd_model


def reload_model_weights(state_dict, model_name=None):
    global last_load_result
    sd_model = model_data.sd_model
    sd_unet.apply_unet("None")
    last_load_result = sd_model.load_state_dict(state_dict, strict=False)
    if model_name is not None:
        sd_model.sd_checkpoint_info.model_name = model_name
    script_callbacks.model_loaded_callback(sd_model)
    sd_unet.apply_unet()
    return last_load_result


def reload_vae():
    script_callbacks.model_loaded_callback(model_data.sd_model)
