"""How objects in a step's arguments enter a graph key: by identity that cannot be confused, and by content.

A captured graph bakes in everything Python decided while it was captured: which patch functions ran, the
numbers their closures held, the tensors they read by address. So a key must change whenever any of that
could: two different objects must never look alike (an `id()` is reused once an object dies, so a new
patch could replay the graph of a dead one), and one object whose content changed must look different.

* `Token(obj)`: the identity of a live object. Equal only to a token of the same object while it lives
  (held weakly where the object allows it, so keys never keep models alive; a dead object's key never
  matches again).
* `signature(obj, soft)`: what a key holds for a non-container leaf. A callable found in the call
  (a patch function, a wrapper, an instance with `__call__`) is its identity plus the content of what it
  closes over: closure cells, defaults, partial arguments, the instance's attributes, walked a few levels
  deep; a function found inside that content is its code (patches create helper closures per call, ToMe's
  unmerge for one, which must not make every call a new key). A GPU tensor found there is its shape, dtype
  and strides and is appended to `soft`: a graph reads it by address, so a call whose tensor is another
  object than the capture read, or the same one whose data moved, is captured again (StepGraphs); a tensor
  the step itself stores (SAG keeps its attention scores in a closure) is the capture's own from then on,
  which each replay rewrites.
  Modules and model patchers are identity only (the model's weights are the fingerprint's business), but a
  module's GPU weights (a patch's own layers, outside the model) are `soft` tensors too. Other plain
  objects are their type: holders of per-run state (EasyCache's, LazyCache's) are new objects every run and
  are read by wrappers outside the graph; one that a step changes is found by the probe (`state_of`).
* `state_of(obj)`: a deeper snapshot of the same walk that also reads plain objects' attributes, random
  generators' states and the numbers set on modules (`module_numbers`); compared before and after a probe call to
  see whether a step changes Python state. The walk also finds where the functions it meets store in their
  modules (`write_targets`): graphs/effects.py sets those again after a replay.

SD Accel's own objects (wrappers, callbacks, attention patches) carry `sd_accel_inert`, a hashable
description of the options that built them (True when there are none): beyond those options they do not
change what a step computes, so they enter a key by name and that description, whichever object it is.
"""
import dis
import enum
import functools
import itertools
import random
import types
import uuid
import weakref

import torch

INERT = "sd_accel_inert"
DEPTH = 4            # levels below a callable that are walked
BUDGET = 4000        # items one signature may visit; beyond that the rest is identity only
MODULE_TENSORS = 64  # a module found in a call with more weights than this enters `soft` by its first one
IDENTITY_ITEMS = 16  # a container past the walk's depth up to this long enters by its items' identities
_PRIMITIVE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
              uuid.UUID, enum.Enum, range, slice)


class Token:
    """The identity of one live object (see the module doc)."""
    __slots__ = ("_ref", "_strong", "_hash", "name")

    def __init__(self, obj):
        self._hash = id(obj)
        self.name = getattr(obj, "__qualname__", None) or type(obj).__name__
        try:
            self._ref, self._strong = weakref.ref(obj), None
        except TypeError:       # not weak-referenceable (builtins, some C types): held strongly
            self._ref, self._strong = None, obj

    def get(self):
        return self._strong if self._ref is None else self._ref()

    def alive(self):
        return self.get() is not None

    def __eq__(self, other):
        if not isinstance(other, Token):
            return NotImplemented
        mine = self.get()
        return mine is not None and mine is other.get()

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return "<%s%s>" % (self.name, "" if self.alive() else " (dead)")


def identity(obj, levels=2):
    """What a key holds for an object past the walk's depth or budget: its identity, held weakly where possible. A
    tuple, list or dict cannot be held weakly, and a key holding one holds its tensors for as long as the key lives
    (keys of calls refused as churn are kept): short ones enter by their items' identities, two levels down.
    Forge's reference-only patches keep each layer's recorded `(k, v)` in a dict of their object's, a new tuple
    every step; held strongly, every step's key would have kept that step's recorded features on the GPU."""
    if levels > 0 and isinstance(obj, (tuple, list, dict)) and len(obj) <= IDENTITY_ITEMS:
        pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return (type(obj).__name__,) + tuple(
            (_dict_key(k), v if isinstance(v, _PRIMITIVE) else identity(v, levels - 1)) for k, v in pairs)
    return ("id", Token(obj))


def is_opaque(obj):
    """Modules and model patchers: identity only (never walked into: weights, huge trees)."""
    return isinstance(obj, torch.nn.Module) or (hasattr(obj, "model_options") and hasattr(obj, "clone"))


class _Walk:
    def __init__(self, deep, soft=None, modules=None):
        self.deep = deep          # state_of: plain objects' attributes and RNG states too
        self.soft = soft          # where GPU tensors found inside objects are collected (signature)
        self.modules = set() if modules is None else modules   # ids of modules whose weights are in `soft`
        self.left = BUDGET
        self.seen = {}
        self.writes = {}          # state_of: write targets of the functions walked, in order (a dict as a set)

    def leaf(self, obj, depth, top=False):
        self.left -= 1
        if isinstance(obj, (Token, *_PRIMITIVE)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        mark = getattr(obj, INERT, None)
        if mark is not None and mark is not False:
            return ("ours", getattr(obj, "__qualname__", type(obj).__name__), mark)
        if self.left <= 0 or depth <= 0:
            return identity(obj)
        hit = self.seen.get(id(obj))
        if hit is not None:
            return ("again", hit)
        self.seen[id(obj)] = len(self.seen)
        return self.compound(obj, depth, top)

    def compound(self, obj, depth, top=False):
        if isinstance(obj, dict):
            return ("D",) + tuple((_dict_key(k), self.leaf(v, depth - 1)) for k, v in obj.items())
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
            return (type(obj).__name__,) + tuple(self.leaf(v, depth - 1) for v in items)
        if is_opaque(obj):
            if self.soft is not None and isinstance(obj, torch.nn.Module):
                self.module_tensors(obj)
            if self.deep and isinstance(obj, torch.nn.Module):
                return ("id", Token(obj), module_numbers(obj))
            return ("id", Token(obj))
        if isinstance(obj, random.Random):
            return ("rng", Token(obj), hash(obj.getstate()))
        if isinstance(obj, torch.Generator):
            return ("gen", Token(obj), obj.device.type, _generator_state(obj) if self.deep else None)
        if isinstance(obj, types.MethodType):   # the method's object is what its closure would be
            owner = obj.__self__
            attrs = getattr(owner, "__dict__", None)
            self.note_writes(obj.__func__)
            return ("bound", Token(owner), Token(obj.__func__),
                    self.leaf(attrs, depth - 1) if isinstance(attrs, dict) and not is_opaque(owner) else None,
                    global_reads(obj.__func__))
        if isinstance(obj, types.FunctionType):
            self.note_writes(obj)
            return self.function(obj, depth) if top else ("code", Token(obj.__code__))
        if isinstance(obj, functools.partial):
            return ("partial", self.leaf(obj.func, depth - 1), self.leaf(obj.args, depth - 1),
                    self.leaf(obj.keywords, depth - 1))
        attrs = getattr(obj, "__dict__", None)
        walk = isinstance(attrs, dict) and (self.deep or callable(obj)) and not isinstance(obj, type)
        attrs = self.leaf(attrs, depth - 1) if walk else None
        if callable(obj) and not isinstance(obj, type):
            call = getattr(type(obj), "__call__", None)
            self.note_writes(call)
            return ("obj", Token(obj), attrs, global_reads(call))
        return ("plain", type(obj).__qualname__, attrs)

    def function(self, fn, depth):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(self.leaf(cell.cell_contents, depth - 1))
            except ValueError:                   # an empty cell (a name assigned later)
                cells.append(("empty",))
        return ("fn", Token(fn), tuple(cells), self.leaf(fn.__defaults__, depth - 1),
                self.leaf(fn.__kwdefaults__, depth - 1), global_reads(fn))

    def note_writes(self, fn):
        """state_of only: the places in their modules the functions walked store to (`write_targets`), collected
        in `self.writes`."""
        if self.deep:
            self.writes.update(dict.fromkeys(write_targets(fn)))

    def module_tensors(self, module):
        """A module's GPU weights go to `soft` (a patch's own layers: a hypernetwork's, moved off the GPU and back
        in place by the host's `model_patches_to`, the same Parameter objects at new addresses). Of a large module
        only the first: reading all of it would cost the host on every call, and `.to()` moves them all."""
        if id(module) in self.modules:     # once per call: IPAdapter's patch on every block holds the same module
            return
        self.modules.add(id(module))
        found = []
        for t in itertools.chain(module.parameters(), module.buffers()):
            if t.device.type == "cpu":
                continue
            if len(found) == MODULE_TENSORS:
                found = found[:1]
                break
            found.append(t)
        self.soft.extend(found)

    def tensor(self, t):
        if t.device.type == "cpu" and t.numel() <= 256:
            return ("C", tuple(t.shape), t.dtype, tuple(t.reshape(-1).tolist()))
        if t.device.type == "cpu":
            return ("X", Token(t), tuple(t.shape), t.dtype)      # host data baked in: identity
        if self.soft is not None:
            self.soft.append(t)
        return ("T", tuple(t.shape), t.dtype, t.stride(), t.device)


def global_reads(fn):
    """The plain values (numbers, flags, strings) a function's code reads from its module: a global name, or an
    attribute of a class or module held by a global name (`FreeUForForge.doFreeU`: Forge's built-in FreeU patch
    applies FreeU or not by a flag its denoiser callback sets before each step, from the user's start/end
    schedule). Such a value decides what the call computes without being in its arguments or its closure: a graph
    captured under one value must not replay under another. The reads are those of the code and of the functions
    nested in it, found in its bytecode once; values are read on every call (a flag changes between steps). For a
    callable object, the caller passes its class's `__call__`."""
    code, names_of = _code_of(fn)
    if code is None:
        return ()
    out = []
    for name, attr in _uses(code)[0]:
        value = names_of.get(name, _MISSING)
        if attr is None:
            if isinstance(value, _PRIMITIVE):
                out.append((name, value))
            continue
        if isinstance(value, types.ModuleType):
            found = vars(value).get(attr, _MISSING)
        elif isinstance(value, type):
            found = next((vars(c)[attr] for c in value.__mro__ if attr in vars(c)), _MISSING)
        else:
            continue
        if isinstance(found, _PRIMITIVE):
            out.append((name + "." + attr, found))
    return tuple(out)


def write_targets(fn):
    """Where a function's code (and the code nested in it) stores in its module: `("global", globals, name)` for a
    global it assigns or deletes (`global` statement), `("attr", holder, name)` for an attribute of a module or
    class held by a global name (Forge's Kohya HRFix patch sets `shared.kohya_shrink_shape` on every block call,
    read by its SAG after the step). A replay does not run that code: graphs.effects sets what a capture stored
    again after each replay."""
    code, names_of = _code_of(fn)
    if code is None:
        return ()
    out = []
    for name, attr in _uses(code)[1]:
        if attr is None:
            out.append(("global", _Held(names_of), name))
            continue
        holder = names_of.get(name)
        if isinstance(holder, (types.ModuleType, type)):
            out.append(("attr", _Held(holder), attr))
    return tuple(out)


def _code_of(fn):
    """(code, module globals) of a function or method, (None, None) for anything else."""
    fn = getattr(fn, "__func__", fn)
    code, names_of = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    return (code, names_of) if code is not None and isinstance(names_of, dict) else (None, None)


class _Held:
    """A module, class or globals dict as part of a hashable target: by identity (a dict is not hashable)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Held) and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


_MISSING = object()
_USES = weakref.WeakKeyDictionary()    # code object -> (its loads, its stores), each (global name, attribute or None)
_ATTR_LOADS = ("LOAD_ATTR", "LOAD_METHOD")
_ATTR_STORES = ("STORE_ATTR", "DELETE_ATTR")
_GLOBAL_STORES = ("STORE_GLOBAL", "DELETE_GLOBAL")


def _uses(code):
    """(loads, stores) of globals in `code` and the code nested in it, each (name, attr or None), in order, each
    once. Loads: (name, attr) for each `name.attr` load of a global, (name, None) for a global loaded otherwise.
    Stores: (name, None) for a global assigned or deleted, (name, attr) for an attribute of a global assigned or
    deleted."""
    found = _USES.get(code)
    if found is None:
        loads, stores, stack = [], [], [code]
        while stack:
            c = stack.pop()
            ins = list(dis.get_instructions(c))
            for i, op in enumerate(ins):
                if op.opname in _GLOBAL_STORES:
                    stores.append((op.argval, None))
                elif op.opname == "LOAD_GLOBAL":
                    after = ins[i + 1] if i + 1 < len(ins) else None
                    if after is not None and after.opname in _ATTR_STORES:
                        stores.append((op.argval, after.argval))
                    else:
                        loads.append((op.argval, after.argval if after is not None and after.opname in _ATTR_LOADS
                                      else None))
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        found = _USES[code] = (tuple(dict.fromkeys(loads)), tuple(dict.fromkeys(stores)))
    return found


MODULE_WALK = 2048   # modules of one module tree whose numbers state_of reads


def module_numbers(module):
    """The plain values (counters, flags) set on a module and its submodules, weights aside: a patch's own
    layers may keep per-call state there (ControlNet-LLLite's modules count their calls in `current_step` to
    follow the user's start/end steps; a replay would neither read nor advance it). For state_of only (a key must
    not change on every call); bounded to the first MODULE_WALK modules."""
    out = []
    for name, m in itertools.islice(module.named_modules(), MODULE_WALK):
        out.extend((name, k, v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PRIMITIVE))
    return tuple(out)


def _dict_key(k):
    return k if isinstance(k, (str, int)) else repr(k)


def _generator_state(g):
    try:
        return bytes(g.get_state().numpy()) if g.device.type == "cpu" else g.get_offset()
    except (RuntimeError, AttributeError):
        return None


def signature(obj, soft=None, modules=None):
    """What a graph key holds for `obj` (see the module doc); GPU tensors inside it appended to `soft`. `modules`:
    a set shared by the signatures of one call, so a module's weights enter `soft` once."""
    return _Walk(deep=False, soft=soft, modules=modules).leaf(obj, DEPTH, top=True)


def state_of(obj):
    """A snapshot of the Python state reachable from `obj`, to compare before and after a call."""
    return state_and_writes(obj)[0]


def state_and_writes(obj):
    """(state_of(obj), the write targets of the functions reachable from it: `write_targets`)."""
    walk = _Walk(deep=True)
    state = walk.leaf(obj, DEPTH + 1, top=True)
    return state, tuple(walk.writes)


def dead_tokens(key):
    """True when `key` (a flat tuple) holds a token of an object that no longer lives: it can never match."""
    stack = [key]
    while stack:
        item = stack.pop()
        if isinstance(item, Token):
            if not item.alive():
                return True
        elif isinstance(item, tuple):
            stack.extend(item)
    return False
