#!/usr/bin/env python3
"""End-to-end check of the SD Accel extension in a real Stable Diffusion WebUI Forge, on the CPU.

Sets up Forge from a snapshot of its public repository as shared/research/forge_feasibility.md does (a
`git archive` of the pinned commit, a venv with the pinned torch and Forge's pins, a random SD1.5
checkpoint, this repo cloned into `extensions/`), all under `--home` (default $SDACCEL_HOME/forge, never
in this repo), then:
  probe     dev/forge_probe.py on the real backend and on the CI stand-in (tests/hosts/a1111/fake_forge):
            the same observations (Forge's Linear, clone, load/unload, LoRA loader, lowvram marking)
  options   GET /sdapi/v1/options lists the sd_accel_* keys; /sd_accel/status says forge from the start
  kernels   default settings: the fused modules are in the run and each is called on every step
            (calls per generation = steps x modules, per op, a fused block's own ops included; each fused
            block once per step); counts that add up; the settings' category. Forge runs with
            SDACCEL_EAGER_PATH=fused: on a CPU the engine would otherwise pick the stock modules
  on/off    the image with SD Accel on and off (PSNR >= 35 dB; CPU: the torch fallbacks, so identical)
  LoRA      a LoRA on the very modules SD Accel replaces (norms, GEGLU projections) changes the image,
            and holds with SD Accel on, off and on again; removed, the image is the plain one again
  switch    a second checkpoint of the same config: patched, its own image, the same with SD Accel off
  hires     a hires-fix generation (a second sampling pass), on vs off
  ControlNet  Forge's built-in ControlNet with a random ControlNet of the checkpoint's config (a unit through
            the API, no preprocessor): it changes the image; its control model runs SD Accel's modules (the
            status says which), each called on every step, as the UNet's are; on vs off the same image
  MultiDiffusion  Forge's built-in MultiDiffusion (its own model_function_wrapper, tiles): SD Accel's step runs
            inside it for every tile batch, with the fused modules; on vs off the same image
  FreeU     Forge's built-in FreeU with a schedule ending at half the steps: its filter calls go through SD Accel's op
            (its own copy of the filter recognised as FreeU's); it changes the image; on vs off the same image
  late wrapper  an extension loaded after SD Accel (dev/forge_late_wrapper.py, installed beside it) replaces SD
            Accel's wrapper: every UNet call still takes SD Accel's eager path (the status counts them); the same image
Exit status 0 when every check passes. `--expect-fused` (with `--env TRITON_INTERPRET=1`) also requires
the Triton kernels to run (in Triton's interpreter: minutes).

  python dev/forge_check.py --forge-git <snapshot of lllyasviel/stable-diffusion-webui-forge> \
      --assets-git <snapshot of AUTOMATIC1111/stable-diffusion-webui-assets>
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

from a1111_check import wait_ready
from forge_checks import Checker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "dfdcbab685e57677014f05a3309b48cc87383167"
ASSETS_COMMIT = "6f7db241d2f8ba7457bac5ca9753331f0c266917"   # the assets commit A1111 v1.10.1 and Forge pin
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
EXTRA = ["setuptools>=77.0.3,<81", "clip-anytorch", "huggingface-guess==0.1.0", "joblib"]
LORA = "sdaccel_forge_check"
CONTROLNET = "sdaccel_forge_check_cn"
LATE_WRAPPER = "zz-sdaccel-check-late-wrapper"   # loads after "sd-accel": Forge loads user extensions by folder name


def say(*a):
    print("[setup]", *a, flush=True)


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit("failed (%d): %s\n%s" % (r.returncode, " ".join(cmd), (r.stderr or r.stdout)[-2000:]))
    return r.stdout


def pip(py, *args):
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check"] + list(args))


def extract(git_dir, commit, dest):
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    archive = subprocess.Popen(["git", "--git-dir", git_dir, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit("git archive %s of %s failed" % (commit, git_dir))


def setup_tree(args, home):
    webui = os.path.join(home, "webui")
    stamp = os.path.join(home, "webui.commit")
    if not (os.path.isfile(os.path.join(webui, "launch.py")) and os.path.isfile(stamp)
            and open(stamp).read().strip() == args.commit):
        if not args.forge_git:
            raise SystemExit("no Forge tree in %s: give --forge-git (a snapshot of lllyasviel/stable-diffusion-"
                             "webui-forge)" % home)
        say("Forge %s from %s -> %s" % (args.commit[:8], args.forge_git, webui))
        extract(args.forge_git, args.commit, webui)
        with open(stamp, "w") as f:
            f.write(args.commit + "\n")
    assets = os.path.join(webui, "repositories", "stable-diffusion-webui-assets")
    if not os.path.isdir(assets) and not args.nowebui:   # the UI serves it; the API alone does not need it
        if not args.assets_git:
            raise SystemExit("the UI needs repositories/stable-diffusion-webui-assets: give --assets-git (a "
                             "snapshot of AUTOMATIC1111/stable-diffusion-webui-assets) or --nowebui")
        extract(args.assets_git, ASSETS_COMMIT, assets)
    return webui


def setup_venv(home, webui):
    venv = os.path.join(home, "venv")
    py = os.path.join(venv, "bin", "python")
    stamp = os.path.join(home, "venv.ok")
    if os.path.isfile(stamp):
        return py
    if not os.path.isfile(py):
        say("venv", venv)
        run([sys.executable, "-m", "venv", venv])
    say("installing %s (minutes the first time)" % " ".join(TORCH))
    pip(py, *TORCH)
    reqs, cons = os.path.join(home, "reqs.txt"), os.path.join(home, "constraints.txt")
    with open(os.path.join(webui, "requirements_versions.txt")) as f, open(reqs, "w") as out:
        # Forge's setuptools pin is older than torch 2.14 allows; its bare `torch` line is the pin above
        out.writelines(ln for ln in f if not ln.startswith(("setuptools", "torch\n")))
    with open(cons, "w") as f:
        f.write("\n".join(TORCH) + "\n")
    say("installing Forge's requirements_versions.txt and %s" % " ".join(EXTRA))
    pip(py, "-r", reqs, "-c", cons)
    pip(py, *EXTRA, "-c", cons)
    open(stamp, "w").close()
    return py


def setup_models(args, webui, py):
    ckpts = os.path.join(webui, "models", "Stable-diffusion")
    s0, s1 = os.path.join(ckpts, "ci_small_s0.safetensors"), os.path.join(ckpts, "ci_small_s1.safetensors")
    if not os.path.isfile(s0):
        if not os.path.isfile(args.ckpt):
            raise SystemExit("no checkpoint %s (shared/tools/make_random_sd15_checkpoint.py --preset small)" % args.ckpt)
        try:
            os.link(args.ckpt, s0)
        except OSError:
            shutil.copyfile(args.ckpt, s0)
    fixtures = os.path.join(REPO, "dev", "forge_fixtures.py")
    if not os.path.isfile(s1):
        say(run([py, fixtures, "ckpt2", s0, s1]).strip())
    lora_dir = os.path.join(webui, "models", "Lora")
    os.makedirs(lora_dir, exist_ok=True)
    lora = os.path.join(lora_dir, LORA + ".safetensors")
    if not os.path.isfile(lora):
        say(run([py, fixtures, "lora", s0, lora]).strip())
    cn_dir = os.path.join(webui, "models", "ControlNet")
    os.makedirs(cn_dir, exist_ok=True)
    cn = os.path.join(cn_dir, CONTROLNET + ".safetensors")
    if not os.path.isfile(cn):
        say(run([py, fixtures, "controlnet", s0, cn]).strip())
    return os.path.basename(s0), os.path.basename(s1)


def setup_extension(webui, py):
    """A fresh clone of this repo's HEAD in extensions/, as a user installs it; its installer, dry run."""
    ext = os.path.join(webui, "extensions", "sd-accel")
    shutil.rmtree(ext, ignore_errors=True)
    run(["git", "clone", "-q", REPO, ext])
    if run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"]).strip():
        say("note: uncommitted changes in %s are not in the clone" % REPO)
    late = os.path.join(webui, "extensions", LATE_WRAPPER, "scripts")
    shutil.rmtree(os.path.dirname(late), ignore_errors=True)
    os.makedirs(late)
    shutil.copy(os.path.join(REPO, "dev", "forge_late_wrapper.py"), late)
    head = run(["git", "-C", ext, "log", "--oneline", "-1"]).strip()
    inst = run([py, os.path.join(ext, "install.py"), "--dry-run"]).strip().splitlines()[-1]
    say("extension %s; install.py: %s" % (head, inst))
    return inst


def probe(webui, py):
    """The CI stand-in's observations against the real Forge's."""
    out = {}
    stand_in = os.path.join(REPO, "tests", "hosts", "a1111", "fake_forge")
    for what, arg in (("forge", ["--forge", webui]), ("stand-in", ["--stand-in", stand_in])):
        text = run([py, os.path.join(REPO, "dev", "forge_probe.py")] + arg)
        line = [ln for ln in text.splitlines() if ln.startswith("PROBE ")][-1]
        out[what] = json.loads(line[len("PROBE "):])
    return out


def launch(args, webui, py, ckpt):
    cmd = [py, "launch.py", "--skip-prepare-environment", "--skip-install", "--always-cpu", "--all-in-fp32",
           "--api", "--server-name", "127.0.0.1", "--port", str(args.port), "--loglevel", "INFO",
           "--ckpt", os.path.join("models", "Stable-diffusion", ckpt)] + (["--nowebui"] if args.nowebui else [])
    # SDACCEL_EAGER_PATH=fused: on a CPU the engine runs the stock modules wherever no graph runs (the faster
    # there), which would hide whether the fused modules are in the run at all; the switch runs them (their torch
    # fallbacks on a CPU, so the image is the same). --env SDACCEL_EAGER_PATH= restores the product's choice.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               SDACCEL_EAGER_PATH="fused")
    for kv in args.env:
        k, _, v = kv.partition("=")
        env[k] = v
    print("[launch] %s (log: %s)" % (" ".join(cmd), args.log), flush=True)
    log = open(args.log, "w")
    return subprocess.Popen(cmd, cwd=webui, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forge-git", help="git dir of a Forge snapshot (needed the first time)")
    ap.add_argument("--commit", default=COMMIT)
    ap.add_argument("--assets-git", help="git dir of a stable-diffusion-webui-assets snapshot (the UI's files)")
    home = os.path.join(os.environ.get("SDACCEL_HOME") or os.path.expanduser("~/.cache/sd_accel"), "forge")
    ap.add_argument("--home", default=home, help="where Forge, its venv and the test files go (%(default)s)")
    ap.add_argument("--ckpt", default=os.path.expanduser(
        "~/.cache/sd_accel/models/checkpoints/sdaccel_random_sd15_small.safetensors"))
    ap.add_argument("--port", type=int, default=7862)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nowebui", action="store_true", help="API only (default: the UI too, as users run it)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the Forge process")
    ap.add_argument("--log", default="forge_check.log")
    ap.add_argument("--expect-fused", action="store_true", help="require the Triton kernels to run")
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--ready-timeout", type=int, default=300)
    args = ap.parse_args()
    os.makedirs(args.home, exist_ok=True)
    webui = setup_tree(args, args.home)
    py = setup_venv(args.home, webui)
    s0, s1 = setup_models(args, webui, py)
    installer = setup_extension(webui, py)
    if args.setup_only:
        return 0
    c = Checker("http://127.0.0.1:%d" % args.port, args, s0, s1, LORA, CONTROLNET)
    c.check("satisfied" in installer, "the extension's install.py under Forge's venv: %s" % installer)
    obs = probe(webui, py)
    c.check(obs["forge"] == obs["stand-in"], "CI's stand-in of Forge observes what the real Forge does: %s"
            % (json.dumps(obs["forge"], sort_keys=True) if obs["forge"] == obs["stand-in"] else json.dumps(obs)))
    proc = launch(args, webui, py, s0)
    try:
        print("[launch] ready after %.1f s" % wait_ready(c.url, proc, args.ready_timeout), flush=True)
        c.run()
    finally:
        stop(proc)
    c.check_log(args.log)
    print("%d passed, %d failed" % (c.n_checks - len(c.failures), len(c.failures)))
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
