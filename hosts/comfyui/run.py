"""One Accelerated KSampler run on ComfyUI, as an object the node drives: prepare, sample, report.

`prepare(model, positive, negative, options, controlnet, cond_only)` patches a clone of the model
(hosts/comfyui/accelerate.py) and copies of the ControlNets in the conds (hosts/comfyui/controlnet.py), and decides
whether the ControlNet chain runs inside the UNet's graph. `AcceleratedRun.sample(sampler)` runs
`sampler(model, positive, negative)` on the patched objects; if the accelerated path itself raises, the
error is logged and the stock sampler's result is returned instead (an interrupt still interrupts;
SDACCEL_STRICT=1, for tests and benchmarks, lets the error through); its live previews arrive a few steps late, so
drawing them never stalls the GPU (hosts/comfyui/previews.py). `report(steps)` gives the run's report
dict and one line: it/s, seconds, peak VRAM, what ran, what fell back and why, graph counts and refusals, and
with the step cache on its LOSSY line (how many steps ran the shallow blocks only).
"""
import contextlib
import logging
import os
from dataclasses import dataclass, field

from ...engine.fp8 import weights as fp8_weights
from ...engine.options import strict
from ...engine.reports import kernel_report, run_report, vram_report
from ...kernels.errors import first_line
from . import accelerate as host
from . import controlnet as host_cn
from . import conv_layout
from . import memory as host_memory
from . import previews as host_previews
from . import step_cache as host_step_cache

log = logging.getLogger("sd_accel")


@dataclass
class AcceleratedRun:
    model: object                     # the user's model, untouched
    positive: list
    negative: list
    options: host.AccelOptions
    patched: object = None            # what sampling runs on
    info: dict = field(default_factory=dict)
    cn_positive: list = None
    cn_negative: list = None
    cn_info: dict = None
    notes: list = field(default_factory=list)
    cn_line: str = None
    timer: object = None
    _before: tuple = None
    _step_cache_runs: int = 0
    cn_set_up_error: str = None       # why the ControlNets run as stock, where their set-up raised

    def sample(self, sampler):
        """`sampler(model, positive, negative)` -> ComfyUI's (latent,) on the accelerated objects."""
        host.new_sampling_run(self.info)
        self._step_cache_runs = host_step_cache.finished_runs(self.info)
        self._before = (kernel_report.snapshot(), host.graph_counts(self.info),
                        host_cn.graph_stats(self.cn_info), run_report.compile_snapshot())
        previews = self._previews()
        try:
            with run_report.RunTimer(getattr(self.patched, "load_device", None)) as self.timer, previews:
                return sampler(self.patched, self.cn_positive, self.cn_negative)
        except Exception as e:  # noqa: BLE001 - never lose the user's run to an acceleration fault
            conv_layout.back_to_stock_layout(self.info.get("graph_state"))
            if not self.accelerated() or _is_interrupt(e) or strict():
                raise
            return self._stock_after(e, sampler)
        finally:
            conv_layout.back_to_stock_layout(self.info.get("graph_state"))
            note = previews.note() if isinstance(previews, host_previews.DeferredPreviews) else None
            if note:
                self.notes.append(note)
            self._finish_controlnets()

    def _previews(self):
        """Live previews a few steps late (hosts/comfyui/previews.py) on an accelerated run; with every option off
        the node is exactly KSampler. SDACCEL_DEFERRED_PREVIEWS=0 keeps ComfyUI's own timing; =always defers
        on a CPU too (tests)."""
        switch = os.environ.get("SDACCEL_DEFERRED_PREVIEWS", "1")
        if not self.accelerated() or switch == "0":
            return contextlib.nullcontext()
        try:
            if switch == "always":
                return host_previews.DeferredPreviews(snapshot=host_previews.first_image_copy)
            return host_previews.DeferredPreviews()
        except ImportError:   # a host without ComfyUI's latent_preview: its callbacks, as they are
            return contextlib.nullcontext()

    def accelerated(self):
        return self.patched is not self.model or bool(self.cn_info and self.cn_info["controlnets"])

    def _stock_after(self, e, sampler):
        log.error("[SD Accel] accelerated sampling failed (%s: %s); running the stock KSampler instead",
                  type(e).__name__, first_line(e, 300))
        self.notes.append("accelerated run failed (%s), result from the stock path" % type(e).__name__)
        st = self.info.get("graph_state")
        if st is not None:
            st.graphs.clear("error during an accelerated run")
        host_cn.release(self.cn_info)
        self.info, self.cn_info = {"options": {}}, None
        with run_report.RunTimer(getattr(self.model, "load_device", None)) as self.timer:
            return sampler(self.model, self.positive, self.negative)

    def _finish_controlnets(self):
        if self.cn_info:
            after = host_cn.graph_stats(self.cn_info)
            before = self._before[2] if self._before else {}
            self.cn_info["graph_delta"] = {k: after[k] - before.get(k, 0) for k in after}
        self.cn_line = host_cn.summary(self.cn_info)
        host_cn.release(self.cn_info)
        if self.cn_line:
            self.notes.append(self.cn_line)

    def report(self, steps):
        """(report dict, one line) of the finished run."""
        k0, g0, _, c0 = self._before
        compiled = run_report.compile_note(c0, run_report.compile_snapshot())
        if compiled:
            self.notes.append(compiled)
        graphs = host.graph_delta(g0, host.graph_counts(self.info))
        derived = fp8_weights.bytes_on()
        if derived:
            self.notes.append("derived weight copies (FP8 / upcast) in VRAM: %.2f GiB" % (derived / 2 ** 30))
        pool = host_memory.pool_settings(self.model)
        if pool is not None and pool.last_report is not None:
            # the VRAM Pool's own measurement of this run (and of its text encode)
            self.notes.append("VRAM Pool: %s%s" % (vram_report.summary_of(pool.last_report),
                                                   " | " + "; ".join(pool.last_notes) if pool.last_notes else ""))
        report = run_report.build(steps, self.timer, kernel_report.summarize(k0, kernel_report.snapshot()),
                                  graphs, self.info.get("options", {}), self.notes,
                                  host_reasons=self.info.get("reasons"),
                                  step_cache=host_step_cache.run_summary(self.info, self._step_cache_runs))
        if pool is not None and pool.last_report is not None:
            report["memory"] = pool.last_report
        if self.cn_set_up_error:
            report["fell_back"]["ControlNets"] = self.cn_set_up_error
        line = run_report.one_line(report) + (" | " + self.cn_line if self.cn_line else "")
        return report, line


def _is_interrupt(e):
    try:
        import comfy.model_management as mm
        return isinstance(e, mm.InterruptProcessingException)
    except Exception:  # noqa: BLE001
        return False


def prepare(model, positive, negative, options, controlnet=True, cond_only=False):
    """The AcceleratedRun for one Accelerated KSampler call (see the module doc)."""
    if options.any():
        patched, info = host.accelerate(model, options)
    else:
        patched, info = model, {"options": options.__dict__.copy()}
    run = AcceleratedRun(model, positive, negative, options, patched, info, positive, negative)
    if controlnet or cond_only:
        try:
            _accelerate_controlnets(run, patched, info, controlnet, cond_only)
        except Exception as e:  # noqa: BLE001 - a fault in SD Accel's set-up must not fail the user's prompt
            if strict():
                raise
            log.exception("[SD Accel] setting up the ControlNets failed; they run as stock")
            run.cn_positive, run.cn_negative, run.cn_info = positive, negative, None
            run.cn_set_up_error = "SD Accel's set-up failed (%s: %s): they run as stock" % (type(e).__name__,
                                                                                          first_line(e))
    return run


def _accelerate_controlnets(run, patched, info, controlnet, cond_only):
    """Copies of the conds whose ControlNets are accelerated, on `run` (the user's conds untouched)."""
    options = run.options
    one_graph = bool(controlnet) and not cond_only and host.runs_controlnets_in_graph(patched, info)
    run.cn_positive, run.cn_negative, run.cn_info = host_cn.accelerate_conds(
        run.positive, run.negative, host_cn.ControlNetOptions(
            fused_kernels=bool(controlnet) and options.fused_kernels, hint_cache=bool(controlnet),
            cuda_graph=bool(controlnet) and options.cuda_graph,
            channels_last=bool(controlnet) and options.channels_last, cond_only=bool(cond_only),
            one_graph=one_graph))
