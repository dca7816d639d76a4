"""dev/setup_chromium.sh, the test set-up's one system step: a Chromium it cannot install never stops the
tests' set-up (dev/test.sh runs under `set -e`), and it says why on one line."""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELD_LOCK = "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)"


def _run(tmp_path, path):
    env = dict(os.environ, PATH=path, SDACCEL_HOME=str(tmp_path / "home"),
               SDACCEL_CHROMIUM=str(tmp_path / "no-chromium"))
    return subprocess.run([shutil.which("bash"), os.path.join(REPO, "dev", "setup_chromium.sh")], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the script calls apt-get directly (the stand-in here)")
def test_a_held_dpkg_lock_is_reported_and_does_not_fail(tmp_path):
    """apt-get answers as it does while another apt holds the dpkg lock (after the minute it waits)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "apt-get"
    stub.write_text("#!/bin/sh\necho '%s' >&2\nexit 100\n" % HELD_LOCK)
    stub.chmod(0o755)
    done = _run(tmp_path, "%s:%s" % (bin_dir, os.environ["PATH"]))
    assert done.returncode == 0, done.stderr
    log = tmp_path / "home" / "chromium-install.log"
    assert done.stderr.splitlines()[-1] == (
        "[setup] could not install chromium (%s); the browser tests cannot run. Full output: %s" % (HELD_LOCK, log))
    assert done.stdout == ""


def test_without_apt_get_it_says_so_and_does_not_fail(tmp_path):
    bin_dir = tmp_path / "bin"   # only what the script needs besides apt-get (and sudo, which it may try)
    bin_dir.mkdir()
    for tool in ("id", "dirname", "mkdir", "grep", "tail"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    done = _run(tmp_path, str(bin_dir))
    assert done.returncode == 0, done.stderr
    assert "the browser tests cannot run" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
