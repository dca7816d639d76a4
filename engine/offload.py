"""UNet block streaming: the weights of some top-level blocks live in (pinned) host memory and are copied to
the GPU on a side stream just before they run, the next blocks' copies in flight while the current one
computes. Host-agnostic (no ComfyUI import); the host decides which tensors are off the GPU.

The unit is a top-level block of an ldm UNetModel in execution order (engine/vram_plan.py's names:
time_embed, label_emb, input_blocks.i, middle_block, output_blocks.i, out); a step runs them in that order
and the next step starts again at the first (cyclic). ComfyUI runs a TimestepEmbedSequential layer by layer
rather than through its __call__, so the trigger is a forward pre-hook on every module of a block that owns
tensors: the first one that runs in a block "enters" the block (later ones are a dict lookup).

Entering streamed block s[i] (streamed = the plan's streamed blocks, in execution order; d = prefetch depth):
  1. copies alive that are not s[i..i+d] are released (normally s[i-1]),
  2. s[i]'s copy is issued if it is not in flight (first step, or after an out-of-order call), the compute
     stream waits on its event, and the block's tensors are swapped to the GPU copies,
  3. the copies of s[i+1..i+d] are issued on the side stream (cyclic), logged as (issued, s[i]).
Entering a resident block releases every copy but the d already issued for the next streamed blocks.
So at most 1 + d streamed blocks are on the GPU at once: vram_plan's window.

Swapping is `tensor.data = other`: Parameter objects, names and state_dict keys stay as they were (LoRA and
weight patches keep working); `remove()` puts every tensor's original data back and drops the copies. GPU
copies get `record_stream(compute stream)`, so the allocator does not reuse their memory before the kernels
that read them have run.

With device=cpu the same logic runs with real copies (clones) and no streams: the order and the swaps are
testable without a GPU.
"""
import torch

from .vram_plan import _UNET_ORDER


def top_level_blocks(unet):
    """[(name, module)] of an ldm UNetModel's top-level blocks in execution order (vram_plan's names)."""
    out = []
    for attr in _UNET_ORDER:
        mod = getattr(unet, attr, None)
        if mod is None:
            continue
        if attr in ("input_blocks", "output_blocks"):
            out.extend(("%s.%d" % (attr, i), b) for i, b in enumerate(mod))
        else:
            out.append((attr, mod))
    return out


def _owned(module):
    """(owner, tensor) for every parameter and buffer under `module`, each tensor once."""
    seen, out = set(), []
    for m in module.modules():
        for d in (m._parameters, m._buffers):
            for t in d.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, t))
    return out


def _nbytes(t):
    return t.numel() * t.element_size()


def off_device_bytes(unet, device):
    """{block name: bytes of its tensors not on `device`} for the top-level blocks, execution order."""
    device = torch.device(device)
    return {name: sum(_nbytes(t) for _, t in _owned(mod) if not _on(t, device)) for name, mod in top_level_blocks(unet)}


def on_device_bytes(module, device):
    """Bytes of the parameters and buffers under `module` that are on `device`."""
    device = torch.device(device)
    return sum(_nbytes(t) for _, t in _owned(module) if _on(t, device))


def _on(t, device):
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class _Block:
    __slots__ = ("name", "tensors", "hosts", "pinned", "copies", "event", "swapped", "nbytes")

    def __init__(self, name):
        self.name, self.tensors, self.hosts, self.pinned = name, [], [], []
        self.copies, self.event, self.swapped, self.nbytes = None, None, False, 0


class BlockStreamer:
    """Streams the tensors of the `streamed` top-level blocks of `unet` to `device` (see the module doc).

    streamed: block names (any order; execution order is used). On a CUDA device only the tensors of those
    blocks that are not already on the device move (the host decides placement); on CPU all of them are
    copied, so the logic can be tested. pinned_cache: a dict reused across installs so host tensors are
    pinned once (keyed by storage pointer, shape, dtype and version). `prefetch_log`: [(issued, computing)].
    """

    def __init__(self, unet, streamed, prefetch_depth=1, device="cuda", pin=None, pinned_cache=None):
        if prefetch_depth < 0:
            raise ValueError("prefetch_depth must be >= 0, got %r" % (prefetch_depth,))
        self.unet, self.device, self.depth = unet, torch.device(device), int(prefetch_depth)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.blocks = top_level_blocks(unet)
        names = [n for n, _ in self.blocks]
        unknown = set(streamed) - set(names)
        if unknown:
            raise ValueError("not top-level UNet blocks: %s" % ", ".join(sorted(unknown)))
        self.streamed = [n for n in names if n in set(streamed)]
        self.cuda = self.device.type == "cuda"
        self.pin = (self.cuda and torch.cuda.is_available()) if pin is None else bool(pin)
        self.pinned_cache = pinned_cache if pinned_cache is not None else {}
        self.prefetch_log, self.installed = [], False
        self.stats = {"copies": 0, "bytes_copied": 0, "demand_loads": 0, "steps": 0}
        self._handles, self._state, self._current, self._active = [], {}, None, []
        self._copy_stream = None

    # -- install / remove -------------------------------------------------------------------------------
    def install(self):
        if self.installed:
            return self
        new_cache = {}
        for name, mod in self.blocks:
            if name not in self.streamed:
                continue
            b = _Block(name)
            for _, t in _owned(mod):
                if self.cuda and _on(t, self.device):
                    continue
                host = t.data
                b.tensors.append(t)
                b.hosts.append(host)
                b.pinned.append(self._pinned(host, new_cache))
                b.nbytes += _nbytes(host)
            self._state[name] = b
        self.pinned_cache.clear()
        self.pinned_cache.update(new_cache)
        self._pos = {n: i for i, n in enumerate(self.streamed)}
        self._active = [n for n in self.streamed if self._state[n].tensors]
        self._apos = {n: i for i, n in enumerate(self._active)}
        order = [n for n, _ in self.blocks]
        # for a block outside the active set: the active index of the next active streamed block after it
        self._next_active = {}
        for p, n in enumerate(order):
            later = [m for m in order[p + 1:] if m in self._apos]
            self._next_active[n] = self._apos[later[0]] if later else 0
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        for name, mod in self.blocks:
            hook = self._make_hook(name)
            for m in mod.modules():
                if any(v is not None for v in m._parameters.values()) or any(v is not None for v in m._buffers.values()):
                    self._handles.append(m.register_forward_pre_hook(hook))
        self.installed, self._current = True, None
        return self

    def remove(self):
        """Puts every streamed tensor's original data back and drops hooks and GPU copies. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for b in self._state.values():
            self._release(b)
        self._state, self._current, self._active, self.installed = {}, None, [], False
        self._copy_stream = None
        return self

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()
        return False

    @property
    def streamed_bytes(self):
        """Bytes copied to the device per step (blocks with nothing off the device are skipped)."""
        return sum(b.nbytes for b in self._state.values())

    def window_bytes(self):
        """Largest sum of 1 + depth cyclically consecutive active streamed blocks: their peak on the device."""
        sizes = [self._state[n].nbytes for n in self._active]
        if not sizes:
            return 0
        k = min(len(sizes), 1 + self.depth)
        return max(sum(sizes[(i + j) % len(sizes)] for j in range(k)) for i in range(len(sizes)))

    def live_blocks(self):
        """Names of the streamed blocks whose copies are on the device now (in flight or swapped in)."""
        return [n for n in self._active if self._state[n].copies is not None]

    # -- internals ---------------------------------------------------------------------------------------
    def _pinned(self, host, new_cache):
        if not self.pin or host.device.type != "cpu":
            return host
        if host.is_pinned():
            return host
        key = (host.data_ptr(), tuple(host.shape), tuple(host.stride()), host.dtype, host._version)
        p = self.pinned_cache.get(key)
        if p is None:
            p = host.pin_memory()
        new_cache[key] = p
        return p

    def _make_hook(self, name):
        def pre_hook(module, args):
            if self._current != name:
                self._enter(name)
        return pre_hook

    def _issue(self, name, computing):
        b = self._state[name]
        if b.copies is not None:
            return
        self.prefetch_log.append((name, computing))
        if self.cuda:
            with torch.cuda.stream(self._copy_stream):
                b.copies = [torch.empty_like(p, device=self.device).copy_(p, non_blocking=True) for p in b.pinned]
                b.event = torch.cuda.Event()
                b.event.record(self._copy_stream)
        else:
            b.copies = [p.clone() for p in b.pinned]
        self.stats["copies"] += 1
        self.stats["bytes_copied"] += b.nbytes

    def _swap_in(self, b):
        if b.swapped:
            return
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(b.event)
            for c in b.copies:
                c.record_stream(cur)
        for t, c in zip(b.tensors, b.copies):
            t.data = c
        b.swapped = True

    def _release(self, b):
        if b.swapped:
            for t, h in zip(b.tensors, b.hosts):
                t.data = h
            b.swapped = False
        b.copies, b.event = None, None

    def _upcoming(self, i, count):
        """The `count` active streamed blocks starting at active index i (cyclic, distinct)."""
        n = len(self._active)
        return [self._active[(i + k) % n] for k in range(min(count, n))]

    def _enter(self, name):
        self._current = name
        if name == self.blocks[0][0]:
            self.stats["steps"] += 1
        if not self._active:
            return
        if name in self._apos:
            i = self._apos[name]
            keep = self._upcoming(i, 1 + self.depth)
            for other in self._active:
                if other not in keep:
                    self._release(self._state[other])
            b = self._state[name]
            if b.copies is None:
                self.stats["demand_loads"] += 1
                self._issue(name, name)
            self._swap_in(b)
            for nxt in keep[1:]:
                self._issue(nxt, name)
        else:
            # a resident block (or a streamed one with nothing off the device): keep only the copies already
            # issued for the next streamed blocks
            keep = self._upcoming(self._next_active[name], self.depth)
            for other in self._active:
                if other not in keep:
                    self._release(self._state[other])
