"""The acceleration options every host offers, as one type; a host derives its own from it where it has more."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class AccelOptions:
    fused_kernels: bool = True     # fused Triton kernels where a module is eligible
    cuda_graph: bool = True        # each step replayed from a CUDA graph where it can be
    channels_last: bool = True     # conv weights in channels_last before the first capture
    attention: str = "auto"        # "auto" keeps the host's own attention
    step_cache: str = "off"        # LOSSY, opt-in: DeepCache's schedule (engine/step_cache/schedule.MODES)
    step_cache_branch: int = 0     # the skip branch: input blocks 0..branch run on cached steps
    precision: str = "fp16"        # "fp8": LOSSY, opt-in: FP8 transformer Linears on sm_89/sm_90 (engine/fp8)
    fp8_weights: str = "fp16 copies"   # fp8-stored weights: kept upcast where VRAM allows, or "as stored"

    def any(self):
        return (self.fused_kernels or self.cuda_graph or self.channels_last or self.attention != "auto"
                or self.step_cache != "off" or self.precision != "fp16")


def strict():
    """SDACCEL_STRICT=1 (tests and benchmarks): an error on SD Accel's own path is raised instead of the run falling
    back to stock, so a fault cannot hide behind a stock image."""
    return os.environ.get("SDACCEL_STRICT") == "1"
