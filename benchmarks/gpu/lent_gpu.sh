#!/usr/bin/env bash
# One call on a lent GPU (../shared/GPU.md), sized for a 15-minute lease: each section has its own time limit
# and writes what it reached under $OUT, so a section cut short still reports and the next one still runs.
#   speed (GPU.md item 2): tokens/s and MFU, plain and autopar, eager and compiled   ~5 min
#   check (item 1): parity, profile and predicted-vs-measured one-GPU plans            <= 2.5 min
#   scale (item 3): Llama-3-8B built on meta, trained with the planner's levers        <= 4 min (init on the
#                   host, AdamW state offloaded: ~10 s per step on an H200; it does not fit an H100's 80 GB)
# Usage there: bash benchmarks/gpu/lent_gpu.sh [speed,check,scale]   (carry .whl: pulp and highspy wheels)
# The plans use the newest committed profile of the GPU found (benchmarks/results/gpu_<kind>_*cluster.json),
# else the dgx-h100 preset; gpu_check profiles afresh and reports that profile beside.
set -u
OUT=${OUT:-/tmp/lent_out}
SECTIONS=${1:-speed,check}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >>"$LOG" 2>&1 || echo "wheel install failed" >>"$LOG"
# autopar.passes and autopar.cost_models live at the repository root (pyproject's package-dir): link them in so
# the tree runs from PYTHONPATH without an install, leaving the image's torch alone.
[ -e autopar/passes ] || ln -s ../passes autopar/passes
[ -e autopar/cost_models ] || ln -s ../cost_models autopar/cost_models
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
profile=$(ls benchmarks/results/gpu_"${kind:-none}"_20*_cluster.json 2>/dev/null | sort -r | head -1)  # newest dated
[ -z "$profile" ] && profile=$(ls benchmarks/results/gpu_"${kind:-none}"_cluster.json 2>/dev/null)
[ -n "$profile" ] && export AUTOPAR_GPU_CLUSTER=$PWD/$profile
echo "plans priced with ${AUTOPAR_GPU_CLUSTER:-the dgx-h100 preset}" >>"$LOG"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)";
  nproc; } >>"$LOG" 2>&1
section() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)" >>"$LOG"
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name exit $? $(date -u +%T)" >>"$LOG"
}
case ",$SECTIONS," in *,speed,*)
  section speed 300 python3 benchmarks/gpu/gpu_speed.py --out "$OUT/speed" --sections speed
  [ -f "$OUT/speed/gpu_speed.json" ] && rm -f "$OUT/speed/speed_partial.json";; esac
case ",$SECTIONS," in *,check,*)
  section check 130 python3 benchmarks/gpu/gpu_check.py --out "$OUT/check" --budget 110
  [ -f "$OUT/check/gpu_check.json" ] && rm -f "$OUT/check/plans_partial.json";; esac
case ",$SECTIONS," in *,scale,*)
  section scale 240 python3 benchmarks/gpu/gpu_speed.py --out "$OUT/scale" --sections scale;; esac
ls -R "$OUT" >>"$LOG"
