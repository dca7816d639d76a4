"""Keys of the condition cache (engine/preprocess/condition_cache.py): sha256 over the source pixels (exact
bytes, shape, dtype) and a canonical JSON "spec" of everything else that changes the output (preprocessor id and
implementation, every parameter, weight-file identity, output-affecting library major versions) and
`CACHE_FORMAT_VERSION`. The preprocessors build their spec from `file_identity` and `library_majors`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Mapping

import torch

CACHE_FORMAT_VERSION = 1      # of an entry: part of every key, so entries of another format are never read


def canonical_json(obj) -> str:
    """Deterministic JSON: sorted keys, no whitespace, ASCII, no NaN. Tuples become lists."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def file_identity(path: str) -> dict:
    """Cheap identity of a weight file or model folder: name + size + mtime (ns) of each file.

    A folder lists every regular file under it (hidden files and `__pycache__` skipped), so a
    changed config.json or preprocessor_config.json changes the key as well as the weights."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return {"name": os.path.basename(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for n in sorted(names):
            if n.startswith("."):
                continue
            p = os.path.join(root, n)
            st = os.stat(p)
            files.append([os.path.relpath(p, path).replace(os.sep, "/"), st.st_size, st.st_mtime_ns])
    return {"name": os.path.basename(path.rstrip(os.sep)), "files": files}


def library_majors(modules: Iterable[str]) -> dict:
    """{module: major version} for the given importable modules ("absent" when not importable)."""
    out = {}
    for name in modules:
        try:
            mod = __import__(name)
            out[name] = str(getattr(mod, "__version__", "?")).split(".")[0]
        except Exception:  # noqa: BLE001 - a broken optional library must not break key building
            out[name] = "absent"
    return out


def frame_key(frame: torch.Tensor, spec: Mapping) -> str:
    """sha256 hex key of one source frame (exact pixel bytes, shape, dtype) under `spec`."""
    t = frame.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256()
    h.update(b"sd_accel.condition_cache\0")
    h.update(str(CACHE_FORMAT_VERSION).encode())
    h.update(b"\0")
    h.update(canonical_json(spec).encode())
    h.update(b"\0")
    h.update(canonical_json({"shape": list(t.shape), "dtype": str(t.dtype)}).encode())
    h.update(b"\0")
    h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()
