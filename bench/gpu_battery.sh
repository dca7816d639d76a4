#!/usr/bin/env bash
# The GPU machine's checks and benchmarks in one command, parts chosen by name, so a session's few device
# calls each run several of them (a call is limited to 10 minutes; rough times on the H200 are given).
#
#   bash bench/gpu_battery.sh tests unet vram        # $OUT must be set (the device tool sets it)
#
# Parts: tests (tests/gpu but test_fp8_gpu.py (part fp8_tests), ~5.5 min on a warm Triton cache, more on a cold one;
# stopped at 560 s with SIGINT, so pytest still prints its summary of what ran; test_a1111_fp8_gpu.py in it needs A1111's
# ldm: the stable-diffusion-sdkit wheel in .whl/, as part a1111_fp8 says), unet (bench_unet.py, 4 configs + TorchCompileModel at sd15_512_b4, ~4 min), cn
# (bench_controlnet.py, cn1 cn2 SDXL cn1, ~3 min), vram (bench_vram.py stock+ours, ~2 min), lowvram_baseline
# (bench_vram.py with ComfyUI's own partial loading too, ~5 min), soak (bench_soak.py, ~3 min), a1111
# (bench_a1111_ldm.py, ~1 min), h2d (bench_h2d.py, ~15 s), kernels (the per-op kernel benches into one log, ~1 min), profile
# (profile_step.py: where an Accelerated KSampler run's time goes, SD1.5 and SDXL at 4 GiB, ~2.5 min; a diagnosis,
# nothing for results.jsonl), first_run (bench_first_run.py: SD1.5 768² on a cold Triton cache, kernels compiled one
# by one and in parallel, one bench_unet process each, ~3 min), tune_gn (tune_group_norm.py: GroupNorm's tiling
# constants swept over an SD1.5 forward's calls, ~2 min; a diagnosis, nothing for results.jsonl), forge
# (bench_forge.py: Forge's own UNet and sampling code, stock vs SD Accel, SD1.5 512², SDXL 1024², and SD1.5 512²
# with Forge's ControlNet, ~4 min; forge_cn: the ControlNet config alone, killed at 240 s; forge_eager: SD1.5 and
# SDXL's stock against SD Accel without graphs alone, rotated pairs, each variant then profiled (`--eager-pairs
# --profile`, configs forge_eager_*; ~5.5 min, killed at 420 s); forge_eager_cn: the same for the ControlNet config,
# not profiled (its rounds take ~1 s a run: ~3 min, killed at 300 s); all four need
# vendor/forge from `bench_forge.py --vendor-from <Forge tree>`, carried, with Forge's diffusers/huggingface_hub
# wheels in vendor/forge/wheels), patches (bench_patches.py's fresh pass: each ComfyUI patch node, stock vs ours vs
# ours without graphs; its --deadline stops starting configs at 320 s, the part is killed at 360 s),
# patches_more (the same fresh pass on dev/patch_nodes.py's LATER cases: HypernetworkLoader, the guidance nodes,
# FreSca, ModelSamplingDiscrete x0, ModelSamplingContinuousV, ModelComputeDtype bf16; estimated 5 min, the same limits), patches_after_refused (its after_refused pass in a process of its own: a capture that fails first, then the SD1.5
# configs, stock vs ours; deadline 200 s, killed at 240 s), server (bench_server.py, the headline: a real ComfyUI
# server, stock vs SD Accel graphs, SD1.5 512² b1 and b4, previews none then latent2rgb in a second server process;
# estimated 3-4 min with the SD1.5 build; no config starts after 200 s, killed at 300 s), server_more (SD1.5 512² b1 +
# ControlNet and img2img, previews none then latent2rgb; the same limits), server_sdxl and server_sdxl_preview (SDXL
# 1024² b1/b4 with previews none / latent2rgb, one server each; server_previews (server's SD1.5 configs with
# previews none and latent2rgb in ONE server, switched per prompt, all four alternating; ~3 min, killed at 300 s); estimated 4-5 min with the SDXL build, 3 min without;
# no config starts after 150 s, killed at 300 s), server_taesd (SD1.5 512² b1 and SDXL 1024² b1 with taesd previews on
# random-weight TAESD decoders; estimated 3 min; no config after 180 s, killed at 300 s). bench_server's parts share
# their random checkpoints in /tmp/sdaccel_bench_server: run server_sdxl before the other SDXL parts in one call, so
# only it builds the SDXL checkpoint. server_hires (a hires fix whose first pass runs a FreeU_V2 clone and whose second
# the plain model, SD1.5 512² → 768², stock vs ours; its notes give each pass's captures per prompt; ~3 min with the
# SD1.5 build, killed at 300 s), server_nodefer (the A/B of the previews' deferral: server's latent2rgb server
# with SDACCEL_DEFERRED_PREVIEWS=0, SD1.5 512² b1 and b4; ~2 min, killed at 300 s), server_fastsave (server's
# SD1.5 configs without previews, ours saving with Save Image (SD Accel) at its default compress level; configs
# named *_fastsave; ~2 min, killed at 300 s), server_sdxl_fastsave (the same for SDXL 1024² b1; ~3-4 min with the SDXL
# build, killed at 300 s), server_sdxl_fp8 (SDXL 1024² b1 and b4, ours with precision fp8 (LOSSY) and Save Image (SD
# Accel); configs *_fastsave_fp8; ~4 min with the SDXL build, killed at 300 s), server_sdxl_fp8_stepcache (SDXL b4, ours
# with fp8 and step_cache interval 3, both LOSSY; ~3 min, killed at 300 s), patches_fp8stored (bench_patches' fresh pass
# on RescaleCFG (a near-plain fp16 model) and the fp8-stored UNet alone; ~2 min, killed at 240 s), tests_previews
# (tests/gpu/test_deferred_preview_gpu.py and test_previews_gpu.py alone, a GPU server with previews; ~1 min, killed
# at 200 s), stepcache (bench_step_cache.py: SD1.5 512² b1 and b4, stock vs our fp16 vs step_cache interval 2,
# interval 3, non-uniform 3, LOSSY modes; deadline 250 s, killed at 300 s), stepcache_sdxl (the same at SDXL 1024² b1,
# its random checkpoint built first; deadline 230 s, killed at 300 s), stepcache_error (step_cache_error.py: per-block
# / whole-UNet / final-latent error of the step cache on the full-size SD1.5 UNet in fp16 at 512², random weights and
# random weights with outlier channels, ~1.5 min), vae (bench_vae.py: VAE decode and encode, stock vs ours vs ours
# without graphs, SD1.5 512² b1/b4, SDXL 1024² whole and tiled; deadline 200 s, killed at 240 s, ~2-3 min), fp8
# (bench_fp8.py: stock vs ours fp16 vs ours fp8 (LOSSY), SD1.5 512² b1/b4, SDXL 1024² b1, plus per-layer FP8 errors;
# deadline 240 s, killed at 300 s), fp8_gemm (bench_fp8_gemm.py --sweep: the FP8 GEMM kernel against cuBLAS fp16 and
# _scaled_mm on SD1.5/SDXL's transformer Linears, with its launch configs swept; ~3 min, killed at 300 s), fp8_gemm_sdxl
# (the same on SDXL's shapes only, BLOCK_K 256 in the sweep, cuBLAS's own FP8 GEMM beside it; ~2 min, killed at 240 s),
# fp8_tma_trial (bench/fp8_gemm_tma_trial.py: the FP8 GEMM with TMA loads, plain and persistent, against ours and
# cuBLAS's FP8 GEMM on SDXL's shapes; a trial for #20, nothing uses its kernel; ~1 min, killed at 200 s), fp8_tests (tests/gpu/test_fp8_gpu.py alone, ~2 min, killed at 240 s), tests_dropped (the dropped-patch test alone, then
# after the patch-node tests that precede it in the file; its failure message names what holds the patch; two logs,
# ~3 min, killed at 120 s and 200 s), tests_capture (tests/gpu/test_patch_nodes_gpu.py's
# failed-capture test alone: capture_failure_run.py in a process of its own, ~1 min, killed at 200 s), tests_more
# (these GPU tests alone: the patch-node cases of dev/patch_nodes.py's LATER and the hypernetwork move, a
# patch's layer moved between runs (capture safety), WaveSpeed's First Block Cache, Tiled Diffusion with and
# without a ControlNet, the inpainting UNet, the model merge nodes, a T2I adapter on the full SD1.5 layout, the VAE's
# layout between decodes (VAE Save); estimated 5 min, killed at 360 s), tests_sdxl (tests/gpu/test_sdxl_gpu.py alone: a
# random full SDXL checkpoint built first, graphs against stock, size conditioning, resolutions; ~3 min, killed at 300 s),
# stock_after (bench_stock_after.py: stock KSampler and ours without graphs before and after one graph run on the
# same loaded model, SD1.5 512² b1 and SDXL 1024² b1; ~3.5 min, killed at 300 s), diagnose_stock_after
# (diagnose_stock_after.py: SDXL 1024² stock KSampler before and after one graph run of ours, with the GPU's
# clocks, the layouts and the kernels by GPU time; a diagnosis, nothing for results.jsonl; ~2.5 min, killed at 240 s),
# diagnose_eager (diagnose_eager.py: SD1.5 512² stock vs ours without graphs, plain and with a refused capture, under
# cProfile and with the GPU's busy time; a diagnosis, nothing for results.jsonl; ~1.5 min, killed at 240 s),
# diagnose_eager_easycache (the same with EasyCache on every variant's model at SDXL 1024²: the plain pair with GPU
# time by kernel against stock's (--kernels), then each eager path held with every apply_model call timed; ~4 min
# with the SDXL build, killed at 240 + 180 s),
# step_kernels (diagnose_step_kernels.py: an Accelerated KSampler run's GPU time kernel by kernel, SDXL 1024² b1 then
# SD1.5 512² b1, graphs replayed; a diagnosis; ~2.5 min with the SDXL build, killed at 240 s),
# diagnose_eager_pag (diagnose_eager.py at SDXL 1024² with PerturbedAttentionGuidance, the plain pair only: stock vs
# ours without graphs, GPU busy time and cProfile each; why that pair ran at 0.92x in session 35; killed at 420 s), diagnose_stock_path (diagnose_stock_path.py: the SDXL then the SD1.5 UNet alone,
# stock vs SD Accel's stand-ins on their stock branch vs the original blocks swapped back vs fused vs stock on
# channels_last conv weights, host and GPU ms per call; a diagnosis; ~2 min with the SDXL build, killed at 150 s
# each),
# fp8_stored (bench_fp8_stored.py: SD1.5 512², the fp8-stored UNet through stock and ours and the fp16 one through
# ours, rotated, then the kernels by GPU time of one image each; ~2 min, killed at 240 s), fp8_stored_peaks
# (bench_fp8_stored.py --peaks: the fp8 UNet alone, stock then ours "as stored" then ours with fp16 copies, the peak
# VRAM of each; ~1.5 min, killed at 200 s), fp8_stored_fast (fp8_stored's rotated speeds with UNETLoader's
# fp8_e4m3fn_fast loads, not profiled; configs *_fast; ~1.5 min, killed at 240 s), as_stored_replay (bench_as_stored_replay.py: a UNet call's GPU time in
# graph replay, stock vs fp16 copies vs "as stored", SD1.5 512² and SDXL 1024²; ~1.5 min with the SDXL build, killed
# at 200 s),
# eager (bench_eager.py: stock vs ours where graphs do not run, SD1.5 512² b1 and SDXL 1024² b1, 12 rotated reps;
# ~4 min with the SDXL build, deadline 330 s, killed at 420 s), eager_caches (bench_eager.py at SD1.5 only, with
# LazyCache and EasyCache pairs beside the plain and refused ones; ~2.5 min, deadline 170 s, killed at 240 s), eager_later
# (the same with APG's and HypernetworkLoader's pairs: guidance around the UNet call, a patch's own layers inside it),
# eager_sdxl_patches (bench_eager.py at
# SDXL 1024² b1 with EasyCache and PAG pairs beside the plain and refused ones; deadline 230 s, killed at 300 s),
# eager_cn (bench_eager.py at SD1.5 and SDXL with the ControlNet pair beside the plain and refused ones, 8 reps;
# deadline 300 s, killed at 400 s),
# text_encode (bench_text_encode.py: CLIP Text Encode on the checkpoint's CLIP vs on Apply SD Accel (CLIP)'s copy,
# SD1.5 and SDXL, plain / weighted / long / clip-skip prompts; ~2 min with the SDXL build, killed at 300 s),
# tests_clip (tests/gpu/test_clip_graphs_gpu.py alone, ~1 min, killed at 200 s),
# samplers_tests (tests/gpu/test_samplers_gpu.py, test_conditioning_gpu.py, test_workflows_gpu.py: samplers beyond euler,
# conditioning nodes, hires fix and split schedules with graphs, ~2 min, killed at 300 s), fp8_profile
# (bench_fp8.py --profile at SDXL 1024² b1: the record, then GPU time by
# kind of kernel, ours fp16 vs fp8; ~2 min with the SDXL build, killed at 300 s),
# png_save (bench_png_save.py on the GPU machine's host CPU: SaveImage's way vs Save Image (SD Accel)'s writer; ~30 s).
# a1111_fp8 (bench_a1111_ldm.py --fp8 at sdp attention: A1111's ldm UNet stock vs ours fp16 vs ours with the LOSSY
# precision fp8 setting, ~1.5 min; then tests/gpu/test_a1111_fp8_gpu.py, ~30 s; killed at 200 + 150 s; needs ldm: carry
# stable-diffusion-sdkit==2.1.5's wheel in .whl/, `pip download --no-deps`; the part a1111 too).
# Each part writes under $OUT/<part>/ (results.jsonl, log.txt) and prints its last lines; append the records
# to bench/results.jsonl as ../shared/BENCH.md says. Needs vendor/ComfyUI (carry it) and, when the device's
# Python lacks them, the wheels in .whl/ (carry it too).
set -u
: "${OUT:?set OUT to a folder for the results}"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 SDACCEL_STRICT=1
COMFY=vendor/ComfyUI

part() {   # part NAME TIMEOUT COMMAND...
  local name=$1 limit=$2
  shift 2
  mkdir -p "$OUT/$name"
  echo "== $name ($limit s max): $*"
  timeout "$limit" "$@" --out "$OUT/$name" > "$OUT/$name/log.txt" 2>&1
  echo "== $name exit $?"
  grep -v "^\[W\|This is technically allowed" "$OUT/$name/log.txt" | tail -8 | cut -c1-400
}

for p in "$@"; do
  case "$p" in
    tests)
      mkdir -p "$OUT/tests"
      timeout -s INT 560 python3 -m pytest tests/gpu -q -rA --ignore=tests/gpu/test_fp8_gpu.py > "$OUT/tests/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/tests/log.txt" | tail -12 | cut -c1-300 ;;
    unet) part unet 330 python3 bench/bench_unet.py --comfy-dir $COMFY --compile sd15_512_b4 ;;
    cn) part cn 300 python3 bench/bench_controlnet.py --comfy-dir $COMFY ;;
    vram) part vram 300 python3 bench/bench_vram.py --comfy-dir $COMFY --variants stock,ours --stock-twice ;;
    lowvram_baseline) part lowvram_baseline 420 python3 bench/bench_vram.py --comfy-dir $COMFY ;;
    soak) part soak 300 python3 bench/bench_soak.py --comfy-dir $COMFY ;;
    a1111) part a1111 150 python3 bench/bench_a1111_ldm.py ;;
    profile) part profile 240 python3 bench/profile_step.py --comfy-dir $COMFY ;;
    first_run) part first_run 500 python3 bench/bench_first_run.py --comfy-dir $COMFY ;;
    tune_gn) part tune_gn 300 python3 bench/tune_group_norm.py ;;
    forge)
      # Forge's pins of diffusers and huggingface_hub in a folder of their own: the other parts keep the image's
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/forge_site \
        vendor/forge/wheels/*.whl
      PYTHONPATH=/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH} part forge 540 python3 bench/bench_forge.py ;;
    forge_eager)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/forge_site \
        vendor/forge/wheels/*.whl
      PYTHONPATH=/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH} part forge_eager 420 python3 bench/bench_forge.py \
        --eager-pairs --profile --reps 8 --configs sd15_512_b1,sdxl_1024_b1 ;;
    forge_eager_cn)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/forge_site \
        vendor/forge/wheels/*.whl
      PYTHONPATH=/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH} part forge_eager_cn 300 python3 bench/bench_forge.py \
        --eager-pairs --reps 8 --configs sd15_512_b1_cn ;;
    forge_cn)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/forge_site \
        vendor/forge/wheels/*.whl
      PYTHONPATH=/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH} part forge_cn 240 python3 bench/bench_forge.py \
        --configs sd15_512_b1_cn ;;
    fp8) part fp8 300 python3 bench/bench_fp8.py --comfy-dir $COMFY --deadline 240 ;;
    fp8_gemm)
      mkdir -p "$OUT/fp8_gemm"
      timeout 300 python3 bench/bench_fp8_gemm.py --sweep --out "$OUT/fp8_gemm" > "$OUT/fp8_gemm/log.txt" 2>&1
      echo "== fp8_gemm exit $?"
      grep -v "^\[W\|This is technically allowed" "$OUT/fp8_gemm/log.txt" | tail -20 | cut -c1-200 ;;
    fp8_tma_trial)
      mkdir -p "$OUT/fp8_tma_trial"
      timeout 200 python3 bench/fp8_gemm_tma_trial.py --out "$OUT/fp8_tma_trial" > "$OUT/fp8_tma_trial/log.txt" 2>&1
      echo "== fp8_tma_trial exit $?"
      grep -v "^\[W\|This is technically allowed" "$OUT/fp8_tma_trial/log.txt" | tail -12 | cut -c1-260 ;;
    fp8_gemm_sdxl)
      mkdir -p "$OUT/fp8_gemm_sdxl"
      timeout 240 python3 bench/bench_fp8_gemm.py --sweep --models sdxl --out "$OUT/fp8_gemm_sdxl" \
        > "$OUT/fp8_gemm_sdxl/log.txt" 2>&1
      echo "== fp8_gemm_sdxl exit $?"
      grep -v "^\[W\|This is technically allowed\|skipped" "$OUT/fp8_gemm_sdxl/log.txt" | tail -10 | cut -c1-230 ;;
    tests_more)
      mkdir -p "$OUT/tests_more"
      timeout 360 python3 -m pytest tests/gpu/test_patch_nodes_gpu.py tests/gpu/test_other_packs_gpu.py \
        tests/gpu/test_inpaint_gpu.py tests/gpu/test_capture_safety_gpu.py tests/gpu/test_model_merge_gpu.py \
        tests/gpu/test_t2i_adapter_gpu.py tests/gpu/test_vae_gpu.py -q -rA \
        -k "HypernetworkLoader or moved or APG or CFGZeroStar or CFGNorm \
        or TCFG or Mahiro or FreSca or Epsilon or x0 or ContinuousV or ComputeDtype or first_block_cache \
        or tiled_diffusion or inpaint \
        or merge or ratios or t2i or vae_save" \
        > "$OUT/tests_more/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/tests_more/log.txt" | tail -24 | cut -c1-300 ;;
    tests_sdxl)
      mkdir -p "$OUT/tests_sdxl"
      timeout 300 python3 -m pytest tests/gpu/test_sdxl_gpu.py -q -rA > "$OUT/tests_sdxl/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " "$OUT/tests_sdxl/log.txt" | tail -12 | cut -c1-300 ;;
    tests_dropped)
      mkdir -p "$OUT/tests_dropped"
      timeout 120 python3 -m pytest tests/gpu/test_patch_nodes_gpu.py -q -rA -k dropped_patch \
        > "$OUT/tests_dropped/alone.txt" 2>&1
      timeout 200 python3 -m pytest tests/gpu/test_patch_nodes_gpu.py -q -rA \
        -k "stored_on_every or never_replays_a_stale or dropped_patch" > "$OUT/tests_dropped/after.txt" 2>&1
      grep -hE "PASSED|FAILED|ERROR|passed|failed|<- " "$OUT"/tests_dropped/*.txt | tail -30 | cut -c1-300 ;;
    tests_capture)
      mkdir -p "$OUT/tests_capture"
      timeout 200 python3 -m pytest tests/gpu/test_patch_nodes_gpu.py -k failed_capture -q -rA \
        > "$OUT/tests_capture/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/tests_capture/log.txt" | tail -12 | cut -c1-300 ;;
    fp8_tests)
      mkdir -p "$OUT/fp8_tests"
      timeout 240 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rA > "$OUT/fp8_tests/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/fp8_tests/log.txt" | tail -12 | cut -c1-300 ;;
    samplers_tests)
      mkdir -p "$OUT/samplers_tests"
      timeout 300 python3 -m pytest tests/gpu/test_samplers_gpu.py tests/gpu/test_conditioning_gpu.py \
        tests/gpu/test_workflows_gpu.py -q -rA \
        > "$OUT/samplers_tests/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/samplers_tests/log.txt" | tail -40 | cut -c1-300 ;;
    fp8_profile) part fp8_profile 300 python3 bench/bench_fp8.py --comfy-dir $COMFY --configs sdxl_1024_b1 \
      --reps 3 --profile --deadline 200 ;;
    patches) part patches 360 python3 bench/bench_patches.py --comfy-dir $COMFY --passes fresh --deadline 320 ;;
    patches_more) part patches_more 360 python3 bench/bench_patches.py --comfy-dir $COMFY --passes fresh --deadline 320 \
      --configs patch_hypernetworkloader,patch_apg,patch_cfgzerostar,patch_cfgnorm,patch_tcfg,patch_mahiro,patch_fresca,patch_epsilon_scaling,patch_modelsamplingdiscrete_x0,patch_modelsamplingcontinuousv,patch_modelcomputedtype_bf16 ;;
    patches_after_refused)
      part patches_after_refused 240 python3 bench/bench_patches.py --comfy-dir $COMFY --passes after_refused \
        --deadline 200 ;;
    server) part server 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none,latent2rgb --deadline 200 \
      --configs server_sd15_512_b1,server_sd15_512_b4 ;;
    server_previews) part server_previews 300 python3 bench/bench_server.py --comfy-dir $COMFY --one-server \
      --previews none,latent2rgb --deadline 200 --configs server_sd15_512_b1,server_sd15_512_b4 ;;
    server_more) part server_more 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none,latent2rgb \
      --deadline 200 --configs server_sd15_512_b1_cn1,server_sd15_512_b1_img2img ;;
    server_sdxl) part server_sdxl 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none --deadline 150 \
      --configs server_sdxl_1024_b1,server_sdxl_1024_b4 ;;
    server_sdxl_preview) part server_sdxl_preview 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews \
      latent2rgb --deadline 150 --configs server_sdxl_1024_b1,server_sdxl_1024_b4 ;;
    server_taesd) part server_taesd 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews taesd --deadline 180 \
      --configs server_sd15_512_b1,server_sdxl_1024_b1 ;;
    server_hires) part server_hires 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none --deadline 200 \
      --configs server_sd15_512_b1_hires_freeu ;;
    server_fastsave) part server_fastsave 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none \
      --ours-saver sdaccel --deadline 200 --configs server_sd15_512_b1,server_sd15_512_b4 ;;
    server_sdxl_fastsave) part server_sdxl_fastsave 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none \
      --ours-saver sdaccel --deadline 150 --configs server_sdxl_1024_b1 ;;
    server_sdxl_fp8) part server_sdxl_fp8 300 python3 bench/bench_server.py --comfy-dir $COMFY --previews none \
      --ours-saver sdaccel --ours-precision fp8 --deadline 150 --configs server_sdxl_1024_b1,server_sdxl_1024_b4 ;;
    server_sdxl_fp8_stepcache) part server_sdxl_fp8_stepcache 300 python3 bench/bench_server.py --comfy-dir $COMFY \
      --previews none --ours-saver sdaccel --ours-precision fp8 --ours-step-cache "interval 3" --deadline 150 \
      --configs server_sdxl_1024_b4 ;;
    patches_fp8stored) part patches_fp8stored 240 python3 bench/bench_patches.py --comfy-dir $COMFY --passes fresh \
      --deadline 200 --configs patch_rescalecfg,patch_unetloader_fp8_e4m3fn ;;
    server_nodefer) part server_nodefer 300 env SDACCEL_DEFERRED_PREVIEWS=0 python3 bench/bench_server.py --comfy-dir \
      $COMFY --previews latent2rgb --deadline 200 --configs server_sd15_512_b1,server_sd15_512_b4 ;;
    tests_previews)
      mkdir -p "$OUT/tests_previews"
      timeout 200 python3 -m pytest tests/gpu/test_deferred_preview_gpu.py tests/gpu/test_previews_gpu.py -q -rA \
        > "$OUT/tests_previews/log.txt" 2>&1
      echo "== tests_previews exit $?"
      tail -15 "$OUT/tests_previews/log.txt" ;;
    stepcache) part stepcache 300 python3 bench/bench_step_cache.py --comfy-dir $COMFY --configs sd15_512_b1,sd15_512_b4 \
      --deadline 250 ;;
    stepcache_sdxl) part stepcache_sdxl 300 python3 bench/bench_step_cache.py --comfy-dir $COMFY --configs sdxl_1024_b1 \
      --deadline 230 ;;
    stepcache_error) part stepcache_error 240 python3 bench/step_cache_error.py --comfy-dir $COMFY --preset sd15 \
      --size 512 --gpu --branches 0,1,2 ;;
    vae) part vae 240 python3 bench/bench_vae.py --comfy-dir $COMFY --deadline 200 ;;
    stock_after) part stock_after 300 python3 bench/bench_stock_after.py --comfy-dir $COMFY --deadline 260 ;;
    diagnose_stock_after) part diagnose_stock_after 240 python3 bench/diagnose_stock_after.py --comfy-dir $COMFY ;;
    eager) part eager 420 python3 bench/bench_eager.py --comfy-dir $COMFY --reps 12 --families sd15,sdxl --deadline 330 ;;
    eager_cn) part eager_cn 400 python3 bench/bench_eager.py --comfy-dir $COMFY --reps 8 --families sd15,sdxl \
      --controlnet --deadline 300 ;;
    eager_caches) part eager_caches 240 python3 bench/bench_eager.py --comfy-dir $COMFY --reps 12 --families sd15 \
      --patches LazyCache,EasyCache --deadline 170 ;;
    eager_later) part eager_later 240 python3 bench/bench_eager.py --comfy-dir $COMFY --reps 12 --families sd15 \
      --patches APG,HypernetworkLoader --deadline 170 ;;
    eager_sdxl_patches) part eager_sdxl_patches 300 python3 bench/bench_eager.py --comfy-dir $COMFY --reps 12 \
      --families sdxl --patches EasyCache,PerturbedAttentionGuidance --deadline 230 ;;
    fp8_stored) part fp8_stored 240 python3 bench/bench_fp8_stored.py --comfy-dir $COMFY --reps 6 --profile ;;
    fp8_stored_fast) part fp8_stored_fast 240 python3 bench/bench_fp8_stored.py --comfy-dir $COMFY --reps 6 \
      --weight-dtype fp8_e4m3fn_fast ;;
    fp8_stored_peaks) part fp8_stored_peaks 200 python3 bench/bench_fp8_stored.py --comfy-dir $COMFY --reps 3 --peaks ;;
    as_stored_replay) part as_stored_replay 200 python3 bench/bench_as_stored_replay.py --comfy-dir $COMFY --reps 5 \
      --families sd15,sdxl ;;
    diagnose_eager) part diagnose_eager 240 python3 bench/diagnose_eager.py --comfy-dir $COMFY ;;
    diagnose_eager_easycache)
      part diagnose_eager_easycache 240 python3 bench/diagnose_eager.py --comfy-dir $COMFY --patch EasyCache \
        --family sdxl --plain-only --kernels
      part diagnose_eager_easycache_sdxl 180 python3 bench/diagnose_eager.py --comfy-dir $COMFY --patch EasyCache \
        --family sdxl --paths --timeline ;;
    diagnose_eager_pag)
      part diagnose_eager_pag 420 python3 bench/diagnose_eager.py --comfy-dir $COMFY --patch PerturbedAttentionGuidance \
        --family sdxl --plain-only ;;
    step_kernels) part step_kernels 240 python3 bench/diagnose_step_kernels.py --comfy-dir $COMFY ;;
    diagnose_stock_path)
      part diagnose_stock_path 150 python3 bench/diagnose_stock_path.py --comfy-dir $COMFY
      part diagnose_stock_path_sd15 150 python3 bench/diagnose_stock_path.py --comfy-dir $COMFY --family sd15 ;;
    text_encode) part text_encode 300 python3 bench/bench_text_encode.py --comfy-dir $COMFY --deadline 200 ;;
    tests_clip)
      mkdir -p "$OUT/tests_clip"
      timeout 200 python3 -m pytest tests/gpu/test_clip_graphs_gpu.py -q -rA > "$OUT/tests_clip/log.txt" 2>&1
      echo "== tests_clip exit $?"
      tail -15 "$OUT/tests_clip/log.txt" ;;
    a1111_fp8)
      part a1111_fp8 200 python3 bench/bench_a1111_ldm.py --fp8 --attention sdp
      timeout 150 python3 -m pytest tests/gpu/test_a1111_fp8_gpu.py -q -rA > "$OUT/a1111_fp8/tests_log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/a1111_fp8/tests_log.txt" | tail -12 | cut -c1-300 ;;
    png_save) mkdir -p "$OUT/png_save"; timeout 120 python3 bench/bench_png_save.py --reps 5 > "$OUT/png_save/log.txt" 2>&1; tail -16 "$OUT/png_save/log.txt" ;;
    h2d)
      mkdir -p "$OUT/h2d"
      timeout 90 python3 bench/bench_h2d.py > "$OUT/h2d/log.txt" 2>&1
      grep -v "^\[W\|This is technically allowed" "$OUT/h2d/log.txt" | tail -16 ;;
    kernels)
      mkdir -p "$OUT/kernels"
      # One file for all of them: the device returns at most 8 files per call, and a part's files must leave room
      # for the other parts' (fp8_gemm has its own part: it sweeps launch configs and takes no --dtype).
      for b in group_norm_silu layer_norm add_layer_norm geglu bias_residual_add quantize_rows upcast_fp8 \
          fourier_low_scale; do
        echo "== bench_$b.py --dtype fp16" >> "$OUT/kernels/log.txt"
        timeout 60 python3 "bench/bench_$b.py" --dtype fp16 2>&1 | grep -v "^\[W\|This is technically allowed" \
          | tee -a "$OUT/kernels/log.txt" | tail -12
      done ;;
    *) echo "unknown part: $p (tests unet cn vram lowvram_baseline soak a1111 h2d kernels profile diagnose_eager diagnose_eager_easycache diagnose_stock_path first_run tune_gn forge patches patches_after_refused server server_more server_sdxl server_sdxl_preview server_taesd server_nodefer server_sdxl_fp8 server_sdxl_fp8_stepcache patches_fp8stored fp8_stored fp8_stored_peaks tests_previews stepcache stepcache_sdxl stepcache_error vae fp8 fp8_gemm fp8_tests text_encode tests_clip)"; exit 2 ;;
  esac
done
