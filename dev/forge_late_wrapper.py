"""A Forge extension script for dev/forge_check.py, installed as its own extension that loads after SD Accel (its
folder sorts after SD Accel's): when its one argument is true, it sets a model_function_wrapper on the run's UNet
patcher after SD Accel's, replacing it, as an extension loaded later that wraps the UNet does. The wrapper calls
the UNet as Forge would, so the image is the one without it. Not part of the extension."""
import gradio as gr

from modules import scripts


class LateWrapperCheck(scripts.Script):
    def title(self):
        return "SD Accel check: late wrapper"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        return [gr.Checkbox(label="set a model_function_wrapper after SD Accel's", value=False)]

    def process_before_every_sampling(self, p, *args, **kwargs):
        if not (args and args[0]):
            return

        def late_wrapper(apply_model, a):
            return apply_model(a["input"], a["timestep"], **a["c"])
        unet = p.sd_model.forge_objects.unet.clone()
        unet.set_model_unet_function_wrapper(late_wrapper)
        p.sd_model.forge_objects.unet = unet
