#!/usr/bin/env python3
"""Installs what SD Accel needs that is missing, and nothing else.

Runs under AUTOMATIC1111/Forge (which executes `extensions/<name>/install.py` with its own `launch`
module importable: `launch.is_installed`, `launch.run_pip`) and standalone (`python install.py`, as
ComfyUI-Manager runs it: plain `python -m pip`).

* only the lines of requirements.txt whose package is missing or outside its version range;
* never torch, torchvision, torchaudio, xformers or triton (the host's own builds): their lines are
  skipped, and while torch is installed every pip call is constrained to the installed versions, so a
  package that would replace them fails to install instead (it is reported and skipped);
* opencv-python-headless only when `import cv2` fails (a user's opencv-python is left alone);
* `--dry-run` prints what it would install and calls no pip at all.
Stdlib only; importable (`plan()`, `main()`) for tests.
"""
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "requirements.txt")
HOST_PACKAGES = ("torch", "torchvision", "torchaudio", "xformers", "triton", "pytorch-triton")
OPENCV = "opencv-python-headless"

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirements(path=REQUIREMENTS):
    """[(name, specifier, line)] of requirements.txt, comments, options and host packages left out."""
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = _NAME.match(line.split(";", 1)[0])
            if not m:
                continue
            name, spec = m.group(1), m.group(3).strip()
            if canonical(name) in HOST_PACKAGES:
                continue
            out.append((name, spec, line))
    return out


def installed_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _satisfied(version, spec):
    """True when `version` meets `spec` (">=1.2,<3"); without `packaging` only presence counts."""
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        try:
            from pip._vendor.packaging.specifiers import SpecifierSet
        except ImportError:
            return True
    try:
        return SpecifierSet(spec).contains(version, prereleases=True)
    except Exception:  # noqa: BLE001 - an odd version string: do not reinstall over it
        return True


def cv2_importable():
    try:
        import cv2
        cv2.Canny  # noqa: B018 - two OpenCV wheels clobbering each other fail here
        return True
    except Exception:  # noqa: BLE001 - a broken cv2 counts as missing
        return False


def plan(requirements=None, is_installed=None, have_cv2=None):
    """The requirement strings to install. `is_installed(name) -> version or None`."""
    is_installed = is_installed or installed_version
    reqs = parse_requirements() if requirements is None else requirements
    todo = []
    for name, spec, line in reqs:
        version = is_installed(name)
        if version is None or not _satisfied(version, spec):
            todo.append(line)
    if not (cv2_importable() if have_cv2 is None else have_cv2):
        todo.append(OPENCV)
    return todo


def _host_constraints():
    """Lines pinning the host packages to what is installed (empty when torch is not installed)."""
    if installed_version("torch") is None:
        return []
    return ["%s==%s" % (p, installed_version(p)) for p in HOST_PACKAGES if installed_version(p)]


def _a1111_launch():
    """A1111's `launch` module when this runs under A1111/Forge's installer, else None."""
    try:
        import launch
    except Exception:  # noqa: BLE001 - standalone: no launch, or someone else's module of that name
        return None
    return launch if hasattr(launch, "run_pip") and hasattr(launch, "is_installed") else None


def _would_pull_host_package(req, constraints_file):
    """Asks pip (dry run) whether installing `req` would install or change torch & co."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", req]
    if constraints_file:
        cmd[4:4] = ["-c", constraints_file]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except Exception:  # noqa: BLE001 - cannot tell: the constraints still protect an installed torch
        return None
    if r.returncode != 0 and "no such option" in r.stderr:
        return None   # pip older than 22.2: no dry run; the constraints still protect an installed torch
    if r.returncode != 0:
        return "pip could not resolve it without changing the host's packages: %s" % (r.stderr.strip()[-300:])
    try:
        import json
        report = json.loads(r.stdout)
    except ValueError:
        return None
    pulled = [i["metadata"]["name"] for i in report.get("install", [])
              if canonical(i.get("metadata", {}).get("name", "")) in HOST_PACKAGES]
    return ("it would install %s" % ", ".join(pulled)) if pulled else None


def install(todo, launch=None, log=print):
    """Installs each requirement of `todo`; returns (installed, refused)."""
    constraints = _host_constraints()
    cfile = None
    if constraints:
        fd, cfile = tempfile.mkstemp(prefix="sd_accel_constraints_", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(constraints) + "\n")
    done, refused = [], []
    try:
        for req in todo:
            why = _would_pull_host_package(req, cfile)
            if why:
                log("[SD Accel] not installing %s: %s" % (req, why))
                refused.append(req)
                continue
            args = ["install", req] + (["-c", cfile] if cfile else [])
            if launch is not None:
                launch.run_pip(" ".join('"%s"' % a if " " in a or "<" in a or ">" in a else a for a in args),
                               "SD Accel requirement: %s" % req)
            else:
                log("[SD Accel] installing %s" % req)
                subprocess.check_call([sys.executable, "-m", "pip"] + args)
            done.append(req)
    finally:
        if cfile:
            os.unlink(cfile)
    return done, refused


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    dry = "--dry-run" in argv
    launch = _a1111_launch()
    todo = plan()
    where = "A1111 launch" if launch is not None else "pip (%s)" % sys.executable
    if not todo:
        print("[SD Accel] requirements satisfied; nothing to install")
        return 0
    if dry:
        print("[SD Accel] would install via %s: %s" % (where, " ".join(todo)))
        keep = _host_constraints()
        if keep:
            print("[SD Accel] host packages kept as they are: %s" % " ".join(keep))
        return 0
    done, refused = install(todo, launch)
    print("[SD Accel] installed: %s%s" % (", ".join(done) or "nothing",
                                          "; refused: %s" % ", ".join(refused) if refused else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
