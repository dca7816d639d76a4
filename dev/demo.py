#!/usr/bin/env python3
"""The main job: one real accelerated generation through a real ComfyUI server.

Starts ComfyUI (yours with --comfyui, else the one dev/setup_env.sh installed) with this pack in its
custom_nodes, loads a checkpoint (yours with --ckpt, else a RANDOM-WEIGHT SD1.5 model built here, which
draws coloured noise, not a picture), queues workflows/sd15_txt2img_accelerated.api.json, saves the image
as ./sd_accel_demo.png and prints the Accelerated KSampler's report (it/s, seconds, peak VRAM, what ran
and what fell back).

The arguments are checked first, with the standard library only, so --help and a bad argument answer at
once; then dev/setup_env.sh prepares $SDACCEL_HOME (default ~/.cache/sd_accel) and the demo restarts in
its venv. Whatever it links for the run (your checkpoint, the pack in custom_nodes) is removed when it
ends, failed or not.
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import comfy_server  # noqa: E402
import fixtures  # noqa: E402

WORKFLOW = os.path.join(REPO, "workflows", "sd15_txt2img_accelerated.api.json")
CKPT_EXTENSIONS = (".safetensors", ".ckpt")
SIZE_RANGE = (64, 2048)        # pixels, a multiple of 8 (the latent is 1/8 of the image)
STEPS_RANGE = (1, 200)
SEED_RANGE = (0, 2 ** 64 - 1)  # the range of ComfyUI's seed widget
OUTPUT = "sd_accel_demo.png"   # in the folder the demo was started from


def say(msg):
    print("[demo] %s" % msg, flush=True)


class RunFailed(Exception):
    """A failure of the run, as one line for the user, and the log that has the rest."""

    def __init__(self, message, log=None):
        super().__init__(message)
        self.log = log


def cache_home():
    """Read at each call, not at import: the tests point it at a temporary folder."""
    return os.environ.get("SDACCEL_HOME") or os.path.expanduser("~/.cache/sd_accel")


# -- arguments (standard library only: checked before any set-up) ---------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line that names the argument and what is wrong, instead of argparse's usage block."""
        self.exit(2, "%s: %s; see --help\n" % (self.prog, message))


def checkpoint_file(path):
    """An existing, readable .safetensors or .ckpt file, as an absolute path."""
    if not os.path.lexists(path):
        raise argparse.ArgumentTypeError("no such file: %s" % path)
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError("not a file: %s" % path)
    if not path.lower().endswith(CKPT_EXTENSIONS):
        raise argparse.ArgumentTypeError("%s is not a checkpoint (want %s)" % (path, " or ".join(CKPT_EXTENSIONS)))
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError("cannot read %s" % path)
    return os.path.abspath(path)


def comfyui_checkout(path):
    """A folder with ComfyUI's main.py and its comfy/ package, as an absolute path."""
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError("no such folder: %s" % path)
    for need in ("main.py", "comfy"):
        if not os.path.exists(os.path.join(path, need)):
            raise argparse.ArgumentTypeError("%s is not a ComfyUI checkout (no %s in it)" % (path, need))
    return os.path.abspath(path)


def int_in(lo, hi, multiple=1):
    """An argparse type: an integer in [lo, hi], a multiple of `multiple`."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError("not an integer: %r" % text) from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError("%d is out of range (%d to %d)" % (n, lo, hi))
        if n % multiple:
            raise argparse.ArgumentTypeError("%d is not a multiple of %d" % (n, multiple))
        return n
    return parse


def build_parser():
    ap = _Parser(prog="dev/demo.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", type=comfyui_checkout, metavar="DIR",
                    help="your ComfyUI checkout (default: $SDACCEL_COMFYUI, else the 2024 ComfyUI the set-up installs)")
    ap.add_argument("--ckpt", type=checkpoint_file, metavar="FILE",
                    help="your own SD1.5 checkpoint, %s (default: a random-weight one)" % " or ".join(CKPT_EXTENSIONS))
    ap.add_argument("--preset", choices=sorted(fixtures.UNET_PRESETS),
                    help="UNet size of the random checkpoint (default small; sd15 = the real SD1.5 shape, slow on CPU)")
    ap.add_argument("--size", type=int_in(*SIZE_RANGE, multiple=8), metavar="PIXELS",
                    help="image width and height, %d to %d, a multiple of 8 (default 512 on GPU, 64 on CPU)"
                    % SIZE_RANGE)
    ap.add_argument("--steps", type=int_in(*STEPS_RANGE), metavar="N",
                    help="sampler steps, %d to %d (default 20 on GPU, 4 on CPU)" % STEPS_RANGE)
    ap.add_argument("--seed", type=int_in(*SEED_RANGE), default=42, metavar="N",
                    help="noise seed, %d to %d (default 42)" % SEED_RANGE)
    ap.add_argument("--gpu", action="store_true",
                    help="let ComfyUI use the GPU (default: --cpu unless CUDA is present)")
    ap.add_argument("--keep-running", action="store_true", help="leave the server up until Ctrl-C")
    return ap


def parse_args(argv):
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.ckpt and a.preset:
        ap.error("--preset sizes the random checkpoint; with --ckpt it has no use")
    env = os.environ.get("SDACCEL_COMFYUI")
    if a.comfyui is None and env:   # checked here, so the message names the variable, not --comfyui
        try:
            a.comfyui = comfyui_checkout(env)
        except argparse.ArgumentTypeError as e:
            ap.error("SDACCEL_COMFYUI: %s" % e)
    return a


# -- set-up: dev/setup_env.sh, then this script again in the venv -----------------------------------------
def in_cache_venv():
    venv = os.path.join(cache_home(), "venv")
    return os.path.realpath(sys.prefix) == os.path.realpath(venv)


def restart_in_venv(a, argv):
    """Runs the set-up (its [setup] lines on stderr, the venv's python on stdout) and re-runs the demo there.
    With --comfyui the set-up also installs that ComfyUI's own requirements into the venv."""
    env = dict(os.environ, SDACCEL_COMFYUI=a.comfyui) if a.comfyui else None
    done = subprocess.run(["bash", os.path.join(HERE, "setup_env.sh")], stdout=subprocess.PIPE, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        sys.exit("[demo] the set-up failed (exit %d): its [setup] lines above say where" % done.returncode)
    vpy = lines[-1]
    os.execv(vpy, [vpy, os.path.abspath(__file__)] + list(argv))


# -- what the run links, removed when it ends ---------------------------------------------------------------
@contextlib.contextmanager
def linked_checkpoint(ckpt, ckpt_dir):
    """Yields the name ComfyUI lists `ckpt` under, linked into `ckpt_dir` for the run only. A link there
    already (left by an older demo, dangling or pointing elsewhere) is replaced; a real file of that name
    that is another file is never touched."""
    name = os.path.basename(ckpt)
    dst = os.path.join(ckpt_dir, name)
    if os.path.exists(dst) and os.path.samefile(dst, ckpt):
        yield name     # already there (the file itself, or someone's link to it): theirs, left as it is
        return
    if os.path.lexists(dst) and not os.path.islink(dst):
        raise RunFailed("%s is another file with the name of your checkpoint; rename one of them" % dst)
    if os.path.islink(dst):
        os.unlink(dst)
    os.symlink(ckpt, dst)
    try:
        yield name
    finally:
        os.unlink(dst)


@contextlib.contextmanager
def pack_unlinked_after(comfy_dir):
    """ComfyServer links the pack into custom_nodes; a link this run made is removed again at its end, so
    your ComfyUI does not keep loading SD Accel from here after the demo."""
    dst = os.path.join(comfy_dir, "custom_nodes", comfy_server.PACK_DIR_NAME)
    had = os.path.lexists(dst)
    try:
        yield
    finally:
        if not had and os.path.islink(dst):
            os.unlink(dst)


def random_checkpoint(comfy_dir, preset, ckpt_dir):
    """The name of the cached random-weight checkpoint, built the first time in a child process whose
    output (ComfyUI's start-up lines) goes to a log. A failed build leaves no partial file."""
    name = "sdaccel_random_sd15_%s.safetensors" % preset
    path = os.path.join(ckpt_dir, name)
    if os.path.exists(path):
        return name
    log = os.path.join(cache_home(), "build_checkpoint.log")
    say("building %s once (a random-weight SD1.5 model, about a minute on a CPU; log: %s)" % (path, log))
    cmd = [sys.executable, os.path.join(HERE, "fixtures.py"), "--comfy-dir", comfy_dir, "--kind", "sd15",
           "--preset", preset, "--out", path]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + ".tmp")   # fixtures writes there first, then renames
        with open(log) as f:
            last = (f.read().strip().splitlines() or ["(empty log)"])[-1]
        raise RunFailed("building the random checkpoint failed: %s" % last, log)
    return name


# -- the run ------------------------------------------------------------------------------------------------
def _rejection(err):
    """ComfyUI's 400 answer to a workflow it will not queue, as one line."""
    try:
        body = json.loads(err.body)
    except ValueError:
        return err.body[:300]
    parts = [body.get("error", {}).get("message", "")]
    for node in body.get("node_errors", {}).values():
        parts += ["%s: %s" % (e.get("message"), e.get("details")) for e in node.get("errors", [])]
    return "; ".join(p for p in parts if p)


def _execution_error(entry):
    """The exception a failed prompt raised inside ComfyUI, as one line."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return "%s in %s: %s" % (data.get("exception_type"), data.get("node_type"),
                                     (data.get("exception_message") or "").strip())
    return "status %s" % entry.get("status", {}).get("status_str")


def generate(srv, name, size, steps, seed):
    """Queues the shipped workflow; returns (finished history entry, wall seconds) or raises RunFailed."""
    wf = comfy_server.load_api_workflow(WORKFLOW, **{"4": {"ckpt_name": name}, "5": {"width": size, "height": size},
                                                     "3": {"steps": steps, "seed": seed}})
    say("queued %s: %dx%d, %d steps, seed %d" % (os.path.relpath(WORKFLOW, REPO), size, size, steps, seed))
    t0 = time.time()
    try:
        entry = srv.run(wf, expect_success=False)
    except comfy_server.PromptRejected as e:
        raise RunFailed("ComfyUI rejected the workflow: %s" % _rejection(e), srv.log_path) from None
    if entry.get("status", {}).get("status_str") != "success":
        raise RunFailed("the prompt failed: %s" % _execution_error(entry), srv.log_path)
    return entry, time.time() - t0


def print_report(srv, entry, wall, size, steps):
    images = srv.output_images(entry)
    out = entry["outputs"]["3"]
    report = out["sdaccel_report"][0]
    dst = os.path.abspath(OUTPUT)
    try:
        shutil.copy(images[0], dst)
        say("image: %s (ComfyUI saved it as %s)" % (dst, images[0]))
    except OSError as e:   # a read-only current folder: the image is still in the run's output folder
        say("image: %s (not copied to %s: %s)" % (images[0], dst, e.strerror))
    say("Accelerated KSampler: %s" % out["text"][0])
    say("it/s: %.2f   prompt wall time: %.1fs   %dx%d, %d steps" % (report["it_s"], wall, size, size, steps))
    print(json.dumps(report, indent=1))


def start(srv):
    """srv.start(), its failure as one line: what went wrong and the last line ComfyUI logged."""
    try:
        srv.start()
    except (RuntimeError, OSError) as e:
        why = str(e).splitlines()[0].rstrip(":")
        last = srv.log_tail(1).strip() if srv.proc is not None else ""
        raise RunFailed("ComfyUI did not start: %s%s" % (why, "; its log ends with: " + last if last else ""),
                        srv.log_path) from None


def serve_and_generate(a, comfy_dir, models, name, gpu, size, steps):
    work = os.path.join(cache_home(), "demo_run")
    os.makedirs(work, exist_ok=True)
    srv = comfy_server.ComfyServer(comfy_dir, sys.executable, work, models, cpu=not gpu)
    with contextlib.suppress(FileNotFoundError):
        os.remove(srv.log_path)   # the server appends: one run, one log
    say("starting ComfyUI %s (%s; log: %s)" % (comfy_dir, "GPU" if gpu else "CPU", srv.log_path))
    t0 = time.time()
    try:
        start(srv)
        say("ComfyUI at %s started in %.1fs" % (srv.url, time.time() - t0))
        entry, wall = generate(srv, name, size, steps, a.seed)
        print_report(srv, entry, wall, size, steps)
        if a.keep_running:
            say("server up at %s; Ctrl-C to stop" % srv.url)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


def run(a):
    """The demo itself, in the venv. Returns the exit status."""
    import torch
    if a.gpu and not torch.cuda.is_available():
        print("dev/demo.sh: --gpu: torch %s sees no CUDA device" % torch.__version__, file=sys.stderr)
        return 2
    gpu = a.gpu or torch.cuda.is_available()
    size, steps = a.size or (512 if gpu else 64), a.steps or (20 if gpu else 4)
    comfy_dir = a.comfyui or os.path.join(cache_home(), "ComfyUI-2024")
    models = os.path.join(cache_home(), "models")
    ckpt_dir = os.path.join(models, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            if a.ckpt:
                name = stack.enter_context(linked_checkpoint(a.ckpt, ckpt_dir))
                say("checkpoint: %s (yours)" % a.ckpt)
            else:
                name = random_checkpoint(comfy_dir, a.preset or "small", ckpt_dir)
                say("checkpoint: %s  <-- RANDOM WEIGHTS (the image is coloured noise, not a picture)" % name)
            stack.enter_context(pack_unlinked_after(comfy_dir))
            serve_and_generate(a, comfy_dir, models, name, gpu, size, steps)
    except RunFailed as e:
        print("[demo] failed: %s" % e, file=sys.stderr)
        if e.log:
            print("[demo] the log: %s" % e.log, file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if not in_cache_venv():
        restart_in_venv(a, argv)   # does not return
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
