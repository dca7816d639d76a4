"""bench_server.py --one-server: ComfyUI's preview method switched per prompt, so prompts with and without live
previews alternate in ONE server process (a server per method compares two processes, whose host speed differs by
more than the previews' cost). ComfyUI reads its launch flag `args.preview_method` at every sampler call
(latent_preview.get_previewer); this node sets it and passes the model through, so the sampler after it runs
with that method. Linked into the bench's own server only: not one of the pack's nodes."""


class BenchPreviewMethod:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "method": (["none", "latent2rgb", "taesd"],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "switch"
    CATEGORY = "sd_accel/bench"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")    # runs on every prompt: the flag is process state, not a cached output

    def switch(self, model, method):
        from comfy.cli_args import LatentPreviewMethod, args
        args.preview_method = LatentPreviewMethod(method)
        return (model,)


NODE_CLASS_MAPPINGS = {"SDAccelBenchPreviewMethod": BenchPreviewMethod}
