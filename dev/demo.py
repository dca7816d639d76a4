#!/usr/bin/env python3
"""The main job: one real accelerated generation through a real ComfyUI server.

Starts ComfyUI (yours with --comfyui, else the one dev/setup_env.sh installed) with this pack in its
custom_nodes, loads a checkpoint (yours with --ckpt, else a RANDOM-WEIGHT SD1.5 model built here, which
draws coloured noise, not a picture), queues workflows/sd15_txt2img_accelerated.api.json and prints
where the image is and the Accelerated KSampler's report (it/s, seconds, peak VRAM, what ran).
Run through dev/demo.sh, which prepares the environment first.
"""
import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import comfy_server  # noqa: E402
import fixtures  # noqa: E402

HOME = os.environ.get("SDACCEL_HOME", os.path.expanduser("~/.cache/sd_accel"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfyui", default=os.environ.get("SDACCEL_COMFYUI") or os.path.join(HOME, "ComfyUI-2024"),
                    help="ComfyUI checkout to run (default: the one dev/setup_env.sh installed)")
    ap.add_argument("--ckpt", help="your own SD1.5 checkpoint file (default: a random-weight one)")
    ap.add_argument("--preset", default="small", choices=sorted(fixtures.UNET_PRESETS),
                    help="UNet size of the random checkpoint (sd15 = the real SD1.5 shape, slow on CPU)")
    ap.add_argument("--size", type=int, default=None, help="image width and height (default 512 on GPU, 64 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps (default 20 on GPU, 4 on CPU)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--gpu", action="store_true", help="let ComfyUI use the GPU (default: --cpu unless CUDA is present)")
    ap.add_argument("--keep-running", action="store_true", help="leave the server up until Ctrl-C")
    a = ap.parse_args()

    import torch
    gpu = a.gpu or torch.cuda.is_available()
    size = a.size or (512 if gpu else 64)
    steps = a.steps or (20 if gpu else 4)
    models = os.path.join(HOME, "models")
    ckpt_dir = os.path.join(models, "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    if a.ckpt:
        name = os.path.basename(a.ckpt)
        dst = os.path.join(ckpt_dir, name)
        if not os.path.exists(dst):
            os.symlink(os.path.abspath(a.ckpt), dst)
        print("checkpoint: %s (yours)" % a.ckpt)
    else:
        name = "sdaccel_random_sd15_%s.safetensors" % a.preset
        fixtures.ensure(os.path.join(ckpt_dir, name), fixtures.build_checkpoint, a.comfyui, "sd15", a.preset,
                        os.path.join(ckpt_dir, name))
        print("checkpoint: %s  <-- RANDOM WEIGHTS (the image is coloured noise, not a picture)" % name)

    work = os.path.join(HOME, "demo_run")
    os.makedirs(work, exist_ok=True)
    srv = comfy_server.ComfyServer(a.comfyui, sys.executable, work, models, cpu=not gpu)
    t0 = time.time()
    srv.start()
    print("ComfyUI at %s started in %.1fs (log: %s)" % (srv.url, time.time() - t0, srv.log_path))
    try:
        wf = comfy_server.load_api_workflow(
            os.path.join(REPO, "workflows", "sd15_txt2img_accelerated.api.json"),
            **{"4": {"ckpt_name": name}, "5": {"width": size, "height": size},
               "3": {"steps": steps, "seed": a.seed}})
        t0 = time.time()
        entry = srv.run(wf)
        wall = time.time() - t0
        images = srv.output_images(entry)
        out = entry["outputs"]["3"]
        report = out["sdaccel_report"][0]
        dst = os.path.join(os.getcwd(), "sd_accel_demo.png")
        shutil.copy(images[0], dst)
        print("image: %s (also %s)" % (dst, images[0]))
        print("Accelerated KSampler: %s" % out["text"][0])
        print("it/s: %.2f   prompt wall time: %.1fs   %dx%d, %d steps" % (report["it_s"], wall, size, size, steps))
        print(json.dumps(report, indent=1))
        if a.keep_running:
            print("server up at %s; Ctrl-C to stop" % srv.url)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
