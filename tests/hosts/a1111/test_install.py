"""install.py: what it would install, without calling pip (the real run is a manual fresh-venv check)."""
import importlib.util
import os
import subprocess
import sys

from unet_util import REPO


def load_install():
    spec = importlib.util.spec_from_file_location("sd_accel_install", os.path.join(REPO, "install.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_requirements_never_list_host_packages(tmp_path):
    inst = load_install()
    names = [inst.canonical(n) for n, _, _ in inst.parse_requirements()]
    assert names == ["numpy", "safetensors", "pillow", "scipy", "einops"]
    req = tmp_path / "r.txt"
    req.write_text("torch>=2\ntorchvision\nnumpy>=1.20  # comment\n-r other.txt\n\nTriton\n"
                   "safetensors; python_version>'3'\n")
    assert [n for n, _, _ in inst.parse_requirements(str(req))] == ["numpy", "safetensors"]


def test_plan_installs_only_what_is_missing_or_too_old():
    inst = load_install()
    reqs = [("numpy", ">=1.24", "numpy>=1.24"), ("scipy", "", "scipy"), ("einops", "", "einops")]
    have = {"numpy": "1.21.0", "scipy": "1.11.0"}
    assert inst.plan(reqs, have.get, have_cv2=True) == ["numpy>=1.24", "einops"]
    assert inst.plan(reqs, {"numpy": "2.0", "scipy": "1", "einops": "0.8"}.get, have_cv2=True) == []
    assert inst.plan([], have.get, have_cv2=False) == ["opencv-python-headless"]


def test_dry_run_calls_no_pip():
    r = subprocess.run([sys.executable, os.path.join(REPO, "install.py"), "--dry-run"],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "[SD Accel]" in out and "torch==" not in out.split("would install")[-1].split("\n")[0]


def test_under_a1111_launch_uses_run_pip(monkeypatch):
    inst = load_install()
    calls = []

    class Launch:
        @staticmethod
        def is_installed(name):
            return False

        @staticmethod
        def run_pip(command, desc=None):
            calls.append(command)

    monkeypatch.setattr(inst, "_would_pull_host_package", lambda req, cfile: None)
    done, refused = inst.install(["einops>=0.6"], Launch)
    assert done == ["einops>=0.6"] and refused == []
    assert calls[0].startswith('install "einops>=0.6"')
    if inst.installed_version("torch"):   # the host's torch pinned for the call
        assert " -c " in calls[0]
    monkeypatch.setattr(inst, "_would_pull_host_package", lambda req, cfile: "it would install torch")
    assert inst.install(["timm"], Launch) == ([], ["timm"])
