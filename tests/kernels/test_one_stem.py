"""Every op in kernels/ is one stem: kernels/<op>.py declares the op <op>, with its fallback, and has its
tests in tests/kernels/test_<op>.py and its benchmark in bench/bench_<op>.py (STYLE.md). Every module of
kernels/ without a leading underscore is an op file, except errors.py (the exception helper every layer
imports)."""
import importlib
import os
import pkgutil

import pytest

import sd_accel.kernels as kernels
from sd_accel.kernels import _dispatch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOT_OPS = {"errors"}
OP_MODULES = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__)
                    if not m.name.startswith("_") and m.name not in NOT_OPS)


def _ops():
    for name in OP_MODULES:
        importlib.import_module(f"{kernels.__name__}.{name}")
    return _dispatch.registered_ops()


def test_every_op_file_declares_the_op_of_its_name():
    ops = _ops()
    assert OP_MODULES, "no op files found"
    for name in OP_MODULES:
        assert name in ops, f"kernels/{name}.py declares no fused op {name!r}"
        assert ops[name].__module__.endswith(f"kernels.{name}"), ops[name].__module__


@pytest.mark.parametrize("path", ["tests/kernels/test_{}.py", "bench/bench_{}.py"])
def test_every_registered_op_has_its_test_and_its_bench(path):
    missing = [path.format(op) for op in _ops() if not os.path.isfile(os.path.join(REPO, path.format(op)))]
    assert not missing, missing


def test_every_registered_op_has_a_fallback():
    assert [op for op, fused in _ops().items() if fused._fallback is None] == []
