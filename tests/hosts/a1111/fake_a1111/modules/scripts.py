"""Stand-in for A1111's `modules.scripts`: the `Script` base class and `AlwaysVisible`."""
AlwaysVisible = object()


class Script:
    def title(self):
        raise NotImplementedError()

    def show(self, is_img2img):
        return True
