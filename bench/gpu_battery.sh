#!/usr/bin/env bash
# The GPU machine's checks and benchmarks in one command, parts chosen by name, so a session's few device
# calls each run several of them (a call is limited to 10 minutes; rough times on the H200 are given).
#
#   bash bench/gpu_battery.sh tests unet vram        # $OUT must be set (the device tool sets it)
#
# Parts: tests (tests/gpu, ~70 s before the patch-node tests, which add an estimated 2 min; killed at 400 s), unet
# (bench_unet.py, 4 configs + TorchCompileModel at sd15_512_b4, ~4 min), cn (bench_controlnet.py, cn1 cn2 SDXL cn1, ~3 min), vram (bench_vram.py stock+ours, ~2 min), lowvram_baseline
# (bench_vram.py with ComfyUI's own partial loading too, ~5 min), soak (bench_soak.py, ~3 min), a1111
# (bench_a1111_ldm.py, ~1 min), h2d (bench_h2d.py, ~15 s), kernels (the per-op kernel benches, ~1 min), profile
# (profile_step.py: where an Accelerated KSampler run's time goes, SD1.5 and SDXL at 4 GiB, ~2.5 min; a diagnosis,
# nothing for results.jsonl), first_run (bench_first_run.py: SD1.5 768² on a cold Triton cache, kernels compiled
# one by one and in parallel, one bench_unet process each, ~3 min), tune_gn (tune_group_norm.py: GroupNorm's tiling
# constants swept over an SD1.5 forward's calls, ~2 min; a diagnosis, nothing for results.jsonl), forge
# (bench_forge.py: Forge's own UNet and sampling code, stock vs SD Accel, SD1.5 512² and SDXL 1024², ~3 min; needs
# vendor/forge from `bench_forge.py --vendor-from <Forge tree>`, carried, with Forge's diffusers/huggingface_hub
# wheels in vendor/forge/wheels), patches (bench_patches.py's fresh pass: each ComfyUI patch node, stock vs ours vs
# ours without graphs; its --deadline stops starting configs at 320 s, the part is killed at 360 s),
# patches_after_refused (its after_refused pass in a process of its own: a capture that fails first, then the SD1.5
# configs, stock vs ours; deadline 200 s, killed at 240 s).
# fp8 (bench_fp8.py: stock vs ours fp16 vs ours fp8 (LOSSY), SD1.5 512² b1/b4, SDXL 1024² b1, plus per-layer FP8
# errors; deadline 240 s, killed at 300 s), fp8_tests (tests/gpu/test_fp8_gpu.py alone, ~2 min, killed at 240 s).
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
      timeout 400 python3 -m pytest tests/gpu -q -rA > "$OUT/tests/log.txt" 2>&1
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
      PYTHONPATH=/tmp/forge_site${PYTHONPATH:+:$PYTHONPATH} part forge 420 python3 bench/bench_forge.py ;;
    fp8) part fp8 300 python3 bench/bench_fp8.py --comfy-dir $COMFY --deadline 240 ;;
    fp8_tests)
      mkdir -p "$OUT/fp8_tests"
      timeout 240 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rA > "$OUT/fp8_tests/log.txt" 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " "$OUT/fp8_tests/log.txt" | tail -12 | cut -c1-300 ;;
    patches) part patches 360 python3 bench/bench_patches.py --comfy-dir $COMFY --passes fresh --deadline 320 ;;
    patches_after_refused)
      part patches_after_refused 240 python3 bench/bench_patches.py --comfy-dir $COMFY --passes after_refused \
        --deadline 200 ;;
    h2d)
      mkdir -p "$OUT/h2d"
      timeout 90 python3 bench/bench_h2d.py > "$OUT/h2d/log.txt" 2>&1
      grep -v "^\[W\|This is technically allowed" "$OUT/h2d/log.txt" | tail -16 ;;
    kernels)
      mkdir -p "$OUT/kernels"
      for b in group_norm_silu layer_norm add_layer_norm geglu bias_residual_add; do
        timeout 60 python3 "bench/bench_$b.py" --dtype fp16 > "$OUT/kernels/$b.txt" 2>&1
        tail -12 "$OUT/kernels/$b.txt"
      done ;;
    *) echo "unknown part: $p (tests unet cn vram lowvram_baseline soak a1111 h2d kernels profile first_run tune_gn forge patches patches_after_refused fp8 fp8_tests)"; exit 2 ;;
  esac
done
