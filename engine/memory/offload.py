"""UNet block streaming: the weights of some stream units live in (pinned) host memory and are copied into a
GPU ring buffer on a side stream just before they run, the next units' copies in flight while the current one
computes. Host-agnostic (no ComfyUI import); the host decides which tensors are off the GPU.

The unit ("block" below) is a stream unit of an ldm UNetModel in execution order (engine/memory/stream_units.py:
time_embed, label_emb, out, each ResBlock or up/downsampler of input_blocks.i, middle_block, output_blocks.i,
each transformer block). ComfyUI runs a TimestepEmbedSequential layer by layer rather than through its
__call__, so the trigger is a forward pre-hook on every module of a unit that owns tensors: the first one that
runs in a unit "enters" it.

Fixed places. Each streamed block gets a fixed place in one ring buffer (engine/memory/ring.py) and its
tensors' `.data` point there for as long as the streamer is installed; the host copy of a block is one
pinned buffer with the same layout (engine/memory/block_buffers.py), so a block is one host-to-device copy.
That buffer becomes the tensors' host data for good (their `.data` views it after `remove()`): the model's own
host copies are freed rather than kept beside it, and the buffers are packed into pinned slabs
(engine/memory/pinned_memory.py), so streaming holds about the weights' own size in host memory. Because the
addresses never change, a CUDA graph captured over a step replays the copies too: the step then costs
max(compute, transfer) instead of the eager step's Python time plus whatever transfer it does not hide.

A step (s = the streamed blocks that have something off the device, d = prefetch depth):
  * the UNet's forward pre-hook starts the step: copies of s[0..d] are issued;
  * entering s[i]: s[i+d]'s copy is issued (any of s[i..i+d] not issued yet too; s[i] itself only when
    blocks ran out of order, a "demand load"), then the compute stream waits for s[i]'s copy;
  * the UNet's forward hook ends the step: the compute stream waits for the copy stream (a capture joins).
A copy first waits for an event recorded on the compute stream when it is issued, so it never overwrites a
place before the kernels issued so far (the place's previous reader among them) have read it; ring_layout
keeps a block's place clear of the d blocks before it, which are computing or in flight then.

Swapping is `tensor.data = view`: Parameter objects, names and state_dict keys stay as they were (LoRA and
weight patches keep working); `remove()` puts every tensor's original data back and frees the ring. While
installed the unet carries a residency token (engine/memory/residency.py), a new one per install, which the
weights fingerprint reads: graphs captured against another ring or other host buffers are never replayed.
Through it, a host that converts conv weights to channels_last in place reaches `relayout` for the streamed
ones.

With device=cpu the same logic runs with real copies into a CPU ring and no streams: the order, the
aliasing of places and the swaps are testable without a GPU.
"""
import torch

from . import residency
from .block_buffers import adopt, block_layout, host_flats
from .pinned_memory import view_as
from .ring import ring_layout
from .stream_units import is_on, owned_tensors, stream_units, unit_modules


class _Block:
    __slots__ = ("name", "tensors", "hosts", "offsets", "nbytes", "host_flat", "place")

    def __init__(self, name):
        self.name, self.tensors, self.hosts, self.offsets = name, [], [], []
        self.nbytes, self.host_flat, self.place = 0, None, 0


class BlockStreamer:
    """Streams the tensors of the `streamed` stream units of `unet` to `device` (see the module doc).

    streamed: block names (any order; execution order is used). On a CUDA device only the tensors of those
    blocks that are not already on the device move (the host decides placement), unless `every_tensor`
    (tests); on CPU all of them are copied, so the logic can be tested. pinned_cache: a dict reused across
    installs so a block's host buffer is built (and pinned) once, keyed by its tensors' pointers (views of it),
    shapes, strides and dtypes.
    `prefetch_log`: [(issued block, block computing then | None at the step's start)].
    """

    def __init__(self, unet, streamed, prefetch_depth=1, device="cuda", pin=None, pinned_cache=None,
                 every_tensor=False):
        if prefetch_depth < 0:
            raise ValueError("prefetch_depth must be >= 0, got %r" % (prefetch_depth,))
        self.unet, self.device, self.depth = unet, torch.device(device), int(prefetch_depth)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.blocks = stream_units(unet)
        names = [n for n, _ in self.blocks]
        unknown = set(streamed) - set(names)
        if unknown:
            raise ValueError("not stream units of this UNet: %s" % ", ".join(sorted(unknown)))
        self.streamed = [n for n in names if n in set(streamed)]
        self.cuda = self.device.type == "cuda"
        self.every_tensor = bool(every_tensor) or not self.cuda
        self.pin = (self.cuda and torch.cuda.is_available()) if pin is None else bool(pin)
        self.pinned_cache = pinned_cache if pinned_cache is not None else {}
        self.prefetch_log, self.installed = [], False
        self.stats = {"copies": 0, "bytes_copied": 0, "demand_loads": 0, "steps": 0}
        self._handles, self._state, self._active = [], {}, []
        self._copy_stream, self.ring = None, None
        self._issued, self._current, self._open, self._where = {}, None, False, {}

    # -- install / remove -------------------------------------------------------------------------------
    def install(self):
        if self.installed:
            return self
        for name, mod in self.blocks:
            if name not in self.streamed:
                continue
            b = _Block(name)
            b.tensors = [t for _, t in owned_tensors(mod) if self.every_tensor or not is_on(t, self.device)]
            b.hosts = [t.data for t in b.tensors]
            b.offsets, b.nbytes = block_layout(b.tensors)
            self._state[name] = b
        self._active = [n for n in self.streamed if self._state[n].tensors]
        self._apos = {n: i for i, n in enumerate(self._active)}
        places, ring = ring_layout([self._state[n].nbytes for n in self._active], self.depth)
        new_cache = {}
        active = [self._state[n] for n in self._active]
        # each block's tensors in one host buffer with the ring's layout (pinned when streaming to a GPU); their
        # host data become views of it, so the model's own host copies are freed, not duplicated
        flats = host_flats([(b.hosts, b.offsets, b.nbytes) for b in active], self.pin,
                           self.pinned_cache, new_cache)
        for b, place, (flat, views) in zip(active, places, flats):
            adopt(b.tensors, b.hosts, views)
            b.place, b.host_flat, b.hosts = place, flat, views
        self.pinned_cache.clear()
        self.pinned_cache.update(new_cache)
        self.ring = torch.empty(ring, dtype=torch.uint8, device=self.device)
        self._where = {}
        for n in self._active:
            b = self._state[n]
            for i, (t, host, off) in enumerate(zip(b.tensors, b.hosts, b.offsets)):
                t.data = view_as(self.ring, b.place + off, host)
                self._where[id(t)] = (b, i)
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        for name, mod in self.blocks:
            hook = self._make_hook(name)
            for m in unit_modules(mod):
                if any(v is not None for v in m._parameters.values()) or any(v is not None for v in m._buffers.values()):
                    self._handles.append(m.register_forward_pre_hook(hook))
        self._handles.append(self.unet.register_forward_pre_hook(lambda m, a: self._step_start()))
        self._handles.append(self.unet.register_forward_hook(lambda m, a, o: self._step_end()))
        residency.mark(self.unet, self)
        self.installed, self._current, self._issued = True, None, {}
        return self

    def remove(self):
        """Puts every streamed tensor's original data back, drops the hooks and frees the ring. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for b in self._state.values():
            for t, host in zip(b.tensors, b.hosts):
                t.data = host
        if self.installed and self._copy_stream is not None:
            # the ring is freed below: nothing may still be copying into it
            try:
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            except RuntimeError:   # the copy stream was left in a failed capture: it copies nothing any more
                pass
        residency.clear(self.unet)
        self._state, self._current, self._active, self._issued, self.installed = {}, None, [], {}, False
        self._open, self._where = False, {}
        self._copy_stream, self.ring = None, None
        return self

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()
        return False

    @property
    def streamed_bytes(self):
        """Bytes copied to the device per step (blocks with nothing off the device are skipped)."""
        return sum(self._state[n].nbytes for n in self._active)

    @property
    def ring_bytes(self):
        """Bytes of the GPU ring the streamed blocks take turns in (0 when not installed)."""
        return 0 if self.ring is None else self.ring.numel()

    def relayout(self, t, memory_format):
        """Stores streamed tensor `t` in `memory_format` (values unchanged), where a host converts layouts in
        place (engine/patches/patching.py: convert_conv_weights): its host copy is converted (and stays so after
        remove(), so later runs start from it), its bytes in the block's host buffer rewritten, and `t` viewed
        over its place in the ring with the new strides. Called between steps, not inside one. False when
        `t` is not streamed here."""
        loc = self._where.get(id(t)) if self.installed else None
        if loc is None:
            return False
        b, i = loc
        host = b.hosts[i]
        if not host.is_contiguous(memory_format=memory_format):
            converted = host.contiguous(memory_format=memory_format)    # a copy: the view is overwritten next
            place = view_as(b.host_flat, b.offsets[i], converted)
            place.copy_(converted)
            # a host tensor is the buffer's view (see host_flat); a device one (tests) keeps its own data
            host = b.hosts[i] = place if host.device.type == "cpu" else converted
        t.data = view_as(self.ring, b.place + b.offsets[i], host)
        self._issued = {}                  # a copy issued before holds the old layout
        return True

    def live_blocks(self):
        """Names of the streamed blocks whose copies were issued in this step and not overwritten since."""
        return [n for n in self._active if n in self._issued]

    # -- internals ---------------------------------------------------------------------------------------
    def _make_hook(self, name):
        def pre_hook(module, args):
            if self._current != name:
                self._enter(name)
        return pre_hook

    def _step_start(self):
        self.stats["steps"] += 1
        if self._open and self.cuda:
            # the last step never ended (an error, or a graph capture that failed and left the copy stream in
            # its invalidated capture): continue on a fresh copy stream
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._open = True
        self._current, self._issued = None, {}
        for n in self._active[:1 + self.depth]:
            self._issue(n, None)

    def _step_end(self):
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        self._open, self._current, self._issued = False, None, {}

    def _issue(self, name, computing):
        b = self._state[name]
        lo, hi = b.place, b.place + b.nbytes
        for other in list(self._issued):      # a place overwritten: that copy is gone (out-of-order calls)
            o = self._state[other]
            if other != name and o.place < hi and lo < o.place + o.nbytes:
                del self._issued[other]
        self.prefetch_log.append((name, computing))
        dst = self.ring[lo:hi]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            free = torch.cuda.Event()
            free.record(compute)                   # the place's previous readers are issued before this
            self._copy_stream.wait_event(free)
            with torch.cuda.stream(self._copy_stream):
                dst.copy_(b.host_flat, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._issued[name] = done
        else:
            dst.copy_(b.host_flat)
            self._issued[name] = True
        self.stats["copies"] += 1
        self.stats["bytes_copied"] += b.nbytes

    def _enter(self, name):
        self._current = name
        i = self._apos.get(name)
        if i is None:
            return                                  # a resident block (or nothing of it off the device)
        for j, n in enumerate(self._active[i:i + 1 + self.depth]):
            if n not in self._issued:
                if j == 0 and self.depth:
                    self.stats["demand_loads"] += 1
                self._issue(n, name)
        done = self._issued[name]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(done)
