"""CUDA-graph replay of one model's step: `StepGraphs.run(fn, args, kwargs)` calls `fn(*args, **kwargs)`
through a graph where a graph reproduces it exactly, and eagerly (at least as fast as stock) where not.

Per call:
  1. guards: no CUDA, another capture under way, a model called inside another model's step (ControlNets in
     the UNet's graph): eager. Weights not all on the GPU (offloaded, partially loaded): eager.
  2. the weights fingerprint (fingerprint.py) and the host's own word for its weight patches (`host_state`):
     when either changes, every graph is dropped; a graph never replays stale weights.
  3. the key (keys.py): the call's structure, shapes, dtypes, values and the identity and content of every
     object in it. A new key's first call is its warm-up and runs eagerly under `probe.probe`, which decides
     whether a capture could reproduce the step; a finding on the first probe is checked again on the next call
     (one-time initialisation, a cache filled once, is not a reason to refuse). A key refused stays eager and
     takes the faster eager path (eager.EagerPaths); its reason is counted in `refused` for the run report.
     A refusal is per key: the model's other keys keep their graphs.
  4. a capturable key is captured on its next call, then replayed: every input tensor is copied into the
     graph's static buffer first. A key whose step reads an input's value on the host (probe: `input_reads`)
     has one graph per value, read before each call (as stock reads it). What the capture run stored in the
     patches' modules is stored again after each replay (effects.py).
Memory: all graphs of one model share one private pool; each graph's static inputs and output stay referenced
for as long as the graph lives; at most `max_graphs` keys (and `max_variants` values per key) are kept: past the
bound, the graphs of keys that can never match again (an object in them died) are dropped, and if that leaves no
room, the whole pool, so graph memory is bounded and freed as a unit.
"""
import logging
import os
from collections import Counter, OrderedDict

import torch

from ..reports import kernel_report
from ..thread_scope import ThreadScope
from ...kernels.errors import first_line
from . import capture, eager, effects, keys, probe, tokens
from .fingerprint import WeightsFingerprint, off_gpu

log = logging.getLogger("sd_accel")
DIAG_LEVEL = logging.WARNING if os.environ.get("SDACCEL_DIAG") == "1" else logging.DEBUG
PROBES = 2           # eager probe calls a key gets before its findings count
MAX_VERDICTS = 256
CHURN = 6            # new keys in a row in one run, none replayed: the key changes on every call

_RUNNING = ThreadScope()   # StepGraphs calls running their function (warm-up or capture) on this thread
_step_running = _RUNNING.entered


class _Entry:
    __slots__ = ("graph", "static_in", "static_out", "kernel_calls", "soft", "effects")


class _Verdict:
    __slots__ = ("probed", "result", "soft_changes")

    def __init__(self):
        self.probed, self.result, self.soft_changes = 0, None, 0


class StepGraphs:
    """Graphs for one model (one UNet, or UNet + ControlNets called as one step). `weights_module`: the
    module whose weights and tree the fingerprint reads (for ComfyUI the BaseModel: its diffusion model and
    its model_sampling); `token_module`: where a block streamer sets its token (default: weights_module)."""

    def __init__(self, weights_module, max_graphs=4, name="unet", max_variants=64, token_module=None):
        self.name = name
        self.max_graphs, self.max_variants = max_graphs, max_variants
        self.fp = WeightsFingerprint(weights_module, token_module)
        self.last_fp = None
        self.entries = OrderedDict()      # (key, values) -> _Entry
        self.verdicts = OrderedDict()     # key -> _Verdict, kept when the graphs are dropped
        self.eager_paths = eager.EagerPaths()
        self.pool = None
        # recaptures: graphs captured again because a tensor inside the call's objects was replaced or moved
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "invalidations": 0, "recaptures": 0}
        self.refused = Counter()          # one-line reason -> calls that ran eagerly for it
        self.last_eager_reason = None
        self._new_in_a_row = []           # keys first seen since the last replay, in this run
        self._churn_epoch = None          # the run they were seen in
        self._warm = set()                # keys that ran eagerly since the weights last changed
        self._soft_churn = set()          # keys whose soft tensors changed since their last replay as captured

    def clear(self, why=None):
        log.log(DIAG_LEVEL, "[SD Accel] clear graphs of %s: %s (%d entries)", self.name, why, len(self.entries))
        if self.entries:
            self.stats["invalidations"] += 1
            if why:
                log.info("[SD Accel] CUDA graphs for %s dropped: %s", self.name, why)
        self.entries.clear()
        self.pool = None

    def clear_if_offloaded(self):
        """Frees the graph memory once the weights have left the GPU (the host unloaded the model)."""
        module = self.fp.module   # None while the model itself is being freed
        p = next(module.parameters(), None) if module is not None else None
        if p is None or not p.is_cuda:
            self.clear("model unloaded")

    def _eager(self, fn, args, kwargs, reason, key=None, device=None):
        self.stats["eager"] += 1
        self.last_eager_reason = reason
        if key is None:
            return fn(*args, **kwargs)
        return self.eager_paths.run(key, fn, args, kwargs, device)

    def run(self, fn, args, kwargs, epoch=None, host_state=None, before_capture=None, warm_after_change=False):
        """`epoch`: an object that stays the same for all steps of one sampling run (None: unknown, re-read
        the module tree on every call). `host_state`: the host's own word for which weight patches are applied
        (ComfyUI: `current_weight_patches_uuid`); a change drops the graphs. `before_capture()`: called before
        a capture; True when it changed the weights' layout (channels_last, kept for graphs: eager steps run
        faster on the layout stock uses), and this call then runs eagerly to compile for the new layout.
        `warm_after_change`: the step makes things from the weights on its first call after they change (derived
        weight copies: FP8, upcast fp8-stored weights); each key's first call after a change then runs eagerly, so
        they are made outside a capture (made inside one, they would live in the graph's memory and be freed
        under it)."""
        if _RUNNING.active():
            return self._eager(fn, args, kwargs, "inside another model's step")
        if eager.under_autograd():
            return self.run_stock(fn, args, kwargs, eager.AUTOGRAD)
        if not torch.cuda.is_available():
            return self._eager(fn, args, kwargs, "no CUDA device", key=(), device=None)
        if torch.cuda.is_current_stream_capturing():
            return self._eager(fn, args, kwargs, "another capture is under way")
        tensors, key, soft = keys.flatten((args, kwargs))
        device = next((t.device for t in tensors if t.is_cuda), None)
        refused = self._refused(key)
        if refused is not None:
            # no graph to key, so no weights check: the next call that replays reads the fingerprint and compares
            # it with the one the last replay saw, so a change made meanwhile is still seen before any replay
            self.refused[refused] += 1
            return self._eager(fn, args, kwargs, refused, key=key, device=device)
        fp, all_cuda = self.fp.read(epoch)
        fp = (fp, host_state)
        if not all_cuda:
            if log.isEnabledFor(DIAG_LEVEL):
                free, total = torch.cuda.mem_get_info()
                log.log(DIAG_LEVEL, "[SD Accel] %s: weights off the GPU: %s (GPU free %.1f of %.1f GiB, torch "
                        "reserved %.1f GiB)", self.name, off_gpu(self.fp.module), free / 2**30, total / 2**30,
                        torch.cuda.memory_reserved() / 2**30)
            self.clear()
            return self._eager(fn, args, kwargs, "weights not all on the GPU (offloaded or partially loaded)",
                               key=("offloaded",), device=None)
        if fp != self.last_fp:
            if self.last_fp is not None:
                self.clear("weights changed (LoRA/patch, reload or device move)")
            self._warm.clear()
        # kept even when equal: the fingerprint's per-run cache hands back this object on the run's later steps, so
        # the next comparison is by identity; an equal one from an earlier run would be compared weight by weight
        self.last_fp = fp
        if device is None:
            return self._eager(fn, args, kwargs, "no input on the GPU")
        if any(t.device.type not in ("cuda", "cpu") for t in tensors):
            return self._eager(fn, args, kwargs, "inputs on another device")
        if epoch is not None and epoch is not self._churn_epoch:
            # churn is within one run: keys an earlier run left unreplayed (its calls refused: a cache pack, another
            # model's shapes) must not get this run's first new keys refused as changing on every call
            self._churn_epoch = epoch
            self._new_in_a_row.clear()
        verdict = self._verdict(key)
        if verdict.result is None and len(self._new_in_a_row) >= CHURN:
            verdict.probed, verdict.result = PROBES, probe.Verdict(self._churn_reason(key))
        if verdict.result is None:
            self._new_in_a_row.append(key)
        if verdict.result is None or (not verdict.result.capturable and verdict.probed < PROBES):
            return self._probe(fn, args, kwargs, tensors, key, verdict, device)
        if not verdict.result.capturable:
            self.refused[verdict.result.reason] += 1
            return self._eager(fn, args, kwargs, verdict.result.reason, key=key, device=device)
        return self._replay(fn, args, kwargs, tensors, soft, key, verdict.result, device, before_capture,
                            warm_after_change)

    def run_eager(self, fn, args, kwargs, reason):
        """A call the host keeps out of graphs for `reason` (counted in `refused`, as a refused key's calls are):
        the faster of the fused and the stock modules, measured per key."""
        self.refused[reason] += 1
        tensors, key, _ = keys.flatten((args, kwargs))
        device = next((t.device for t in tensors if t.is_cuda), None)
        return self._eager(fn, args, kwargs, reason, key=("host refused",) + key, device=device)

    def run_stock(self, fn, args, kwargs, reason):
        """A call the host keeps to its own modules for `reason` (no graphs, no fused kernels; counted in
        `refused`)."""
        self.refused[reason] += 1
        self.stats["eager"] += 1
        self.last_eager_reason = reason
        return self.eager_paths.run_stock(fn, args, kwargs)

    def may_replay(self):
        """Whether a graph is held or a key is known to capture: only then do the weights need the layout the
        graphs are captured over (a model whose every key was refused runs eagerly, fastest in stock's layout)."""
        return bool(self.entries) or any(v.result is not None and v.result.capturable
                                         for v in self.verdicts.values())

    def _refused(self, key):
        """The reason a key whose probes are done was refused, or None (a key not seen, still probing, or
        capturable)."""
        v = self.verdicts.get(key)
        if v is None or v.result is None or v.result.capturable or v.probed < PROBES:
            return None
        self.verdicts.move_to_end(key)
        return v.result.reason

    def _churn_reason(self, key):
        diff = keys.key_diff(key, self._new_in_a_row[-1])
        where = diff[0][1] if isinstance(diff, list) and diff else diff
        return "the call's graph key changes on every call (%s)" % str(where)[:120]

    def _verdict(self, key):
        v = self.verdicts.get(key)
        if v is None:
            if self.verdicts:
                other = next(reversed(self.verdicts))
                log.log(DIAG_LEVEL, "[SD Accel] new graph key for %s: %s", self.name, keys.key_diff(key, other))
            v = self.verdicts[key] = _Verdict()
            while len(self.verdicts) > MAX_VERDICTS:
                self._soft_churn.discard(self.verdicts.popitem(last=False)[0])
        else:
            self.verdicts.move_to_end(key)
        return v

    def _probe(self, fn, args, kwargs, tensors, key, verdict, device):
        """A key's warm-up: eager, on the inputs a capture would see (host-side conds already on the GPU)."""
        moved = [keys.static_copy(t, device) if not t.is_cuda else t for t in tensors]
        g_args, g_kwargs = keys.rebuild((args, kwargs), iter(moved))
        with eager.cudnn_autotuned(eager.autotune_now()), _step_running():
            out, result = probe.probe(fn, g_args, g_kwargs, moved)
        verdict.probed += 1
        self._warm.add(key)
        verdict.result = result
        if not result.capturable and verdict.probed >= PROBES:
            self.refused[result.reason] += 1
        self.stats["eager"] += 1
        self.last_eager_reason = "warm-up call for a new shape"
        if not result.capturable:
            level = logging.INFO if verdict.probed >= PROBES else DIAG_LEVEL
            log.log(level, "[SD Accel] %s: no CUDA graph for this call: %s", self.name, result.reason)
        return out

    def _replay(self, fn, args, kwargs, tensors, soft, key, result, device, before_capture=None,
                warm_after_change=False):
        host_values = {i: tensors[i].detach().cpu() for i in result.input_reads}
        full = (key, tuple(tuple(v.reshape(-1).tolist()) for v in host_values.values()))
        entry = self.entries.get(full)
        if entry is not None and keys.soft_changed(entry.soft, soft):
            entry = self._soft_changed(full, key, soft)
            if entry is False:
                return self._eager(fn, args, kwargs, self.verdicts[key].result.reason, key=key, device=device)
        fresh = entry is None
        warm_up = None
        if fresh and before_capture is not None and before_capture():
            warm_up = "warm-up call for the graph's memory layout"
        elif fresh and warm_after_change and key not in self._warm:
            warm_up = "warm-up call after the weights changed (their derived copies made outside the capture)"
        if warm_up:
            self._warm.add(key)
            with eager.cudnn_autotuned(eager.autotune_now()), _step_running():
                self.stats["eager"] += 1
                self.last_eager_reason = warm_up
                return eager.eager_call(fn, args, kwargs)
        if fresh:
            entry = self._capture(fn, args, kwargs, tensors, key, full, device, host_values, result.writes)
            if entry is None:
                return self._eager(fn, args, kwargs, "capture failed", key=key, device=device)
        else:
            self.entries.move_to_end(full)
            if self._soft_churn and key in self._soft_churn:   # empty on nearly every replay: no key hashed
                self._soft_churn.discard(key)
                verdict = self.verdicts.get(key)
                if verdict is not None:
                    verdict.soft_changes = 0   # replayed as captured: the limit counts changes in a row
        for s, t in zip(entry.static_in, tensors):
            s.copy_(t, non_blocking=True)
        entry.graph.replay()
        if entry.effects:
            effects.apply(entry.effects)
        self.stats["replays"] += 1
        self._new_in_a_row.clear()
        if entry.kernel_calls and not fresh:
            kernel_report.replayed(entry.kernel_calls)
        return keys.map_tensors(entry.static_out, lambda t: t.clone())

    def _soft_changed(self, full, key, soft):
        """A tensor inside the call's objects is another object than the capture read, or its data moved (the
        graph reads it by address): the graph is captured again; a key whose tensors change before every call is
        refused. None (capture) or False."""
        changed = keys.soft_changed(self.entries.pop(full).soft, soft)
        log.log(DIAG_LEVEL, "[SD Accel] %s: tensors inside the call's objects replaced (%s): captured again", self.name,
                ", ".join("#%d %s" % (i, tuple(soft[i].shape)) for i in changed[:4]))
        v = self.verdicts[key]
        v.soft_changes += 1
        self._soft_churn.add(key)
        if v.soft_changes <= CHURN:
            self.stats["recaptures"] += 1
            return None
        v.probed, v.result = PROBES, probe.Verdict("a tensor the step reads is replaced before every call")
        return False

    def _make_room(self, key):
        live = {k for k, _ in self.entries}
        if key not in live and len(live) >= self.max_graphs:
            # a key holding an object that died (a patch of a clone the host dropped when the user changed a node)
            # never matches again: its graphs go first, and the keys still in use keep theirs
            for f in [f for f in self.entries if tokens.dead_tokens(f[0])]:
                del self.entries[f]
            live = {k for k, _ in self.entries}
        if key not in live and len(live) >= self.max_graphs:
            self.clear("more than %d shapes in use" % self.max_graphs)
        variants = [f for f in self.entries if f[0] == key]
        for f in variants[:max(0, len(variants) - self.max_variants + 1)]:
            del self.entries[f]

    def _capture(self, fn, args, kwargs, tensors, key, full, device, host_values, writes=()):
        self._make_room(key)
        if self.pool is None or not self.entries:
            # a pool handle lives only while a graph captured into it does: capturing into one whose graphs
            # are all gone fails an assert inside torch's allocators and leaves them half in capture mode
            self.pool = torch.cuda.graph_pool_handle()
        entry = _Entry()
        entry.static_in = [keys.static_copy(t, device) for t in tensors]   # CPU conds get GPU buffers
        s_args, s_kwargs = keys.rebuild((args, kwargs), iter(entry.static_in))
        graph = torch.cuda.CUDAGraph()
        k0 = kernel_report.snapshot()
        try:
            torch.cuda.synchronize()
            with eager.cudnn_autotuned(eager.autotune_now()), _step_running(), \
                    capture.capturing(graph, self.pool, entry.static_in, host_values):
                out = fn(*s_args, **s_kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the step raised inside the capture: run it eagerly
            kernel_report.rollback(k0)
            self._capture_failed(e, key, graph, entry)
            return None
        entry.graph = graph
        entry.static_out = out
        entry.effects = effects.record(writes)   # what the step stored in its modules: stored again per replay
        # tensors inside the call's objects as they are after the capture (the capture's own where the step
        # stored one): later calls copy theirs into these (see tokens.signature)
        entry.soft = keys.soft_marks(keys.flatten((args, kwargs)).soft)
        # which fused kernels (or fallbacks) the graph holds: counted again on every replay
        entry.kernel_calls = kernel_report.calls_between(k0, kernel_report.snapshot())
        self.entries[full] = entry
        self.stats["captures"] += 1
        return entry

    def _capture_failed(self, e, key, graph, entry):
        reason = "capture failed (%s: %s)" % (type(e).__name__, first_line(e, 160))
        log.warning("[SD Accel] CUDA graph capture failed for %s (%s); running eagerly", self.name, reason)
        log.log(DIAG_LEVEL, "[SD Accel] where the capture failed", exc_info=True)
        # what the failed capture allocated (the traceback's tensors, the graph and its pool) is kept: under
        # cudaMallocAsync freeing an unreplayed capture's allocations aborts the process, and the driver would
        # hand an invalidated capture's addresses out again; a key fails at most once, so this is bounded
        capture.keep_failed_capture(e, graph, self.pool, entry.static_in)
        if isinstance(e, capture.CaptureInvalidated):
            self.stats["invalidations"] += 1
            self.clear("a capture was invalidated")
        if isinstance(e, torch.cuda.OutOfMemoryError):
            self.clear("out of memory while capturing")
            return   # not the key's fault: it may capture later, with memory free
        v = self.verdicts.get(key)
        if v is not None:
            v.probed, v.result = PROBES, probe.Verdict(reason)
