#!/usr/bin/env bash
# The prepared GPU check, for a CUDA machine with PyTorch and Triton but no network, MLflow or DVC: ~8 minutes
# on one H200 (conf/sweep/gpu_check.yaml): bf16 attention at head dim 128, causal and non-causal, S = 1k..16k, and
# bf16 matmul at 4096³ and 8192³ (at 64x64x32 tiles, then 128x128x64), forward and forward + backward, against
# every peer; fp8 matmul (per-tensor scaled e4m3, 128x128x64 tiles) at 4096³ and 8192³ against torch._scaled_mm,
# forward only; then tile=auto. By the rough estimate (every SDPA backend present) the points end at ~416 s of the
# 450 s budget, tile=auto last: the first it would skip. None of it has run on a GPU yet: no figure is measured.
#
#   scripts/gpu-check.sh OUTDIR [WHEELS_DIR] [gpucheck flags: --train, --budget-s S, --sweep NAME]
#   scripts/gpu-check.sh OUTDIR --dry-run        # CPU, tiny shapes: what the tests run
#
# It prints each point's rough device time first (posttrainllm/lab/approval.py) and starts no point that would,
# by that estimate, end after --budget-s (450 s); summary.json has each point's estimate and its measured time.
#
# WHEELS_DIR holds the few pure-Python wheels such a machine lacks (hydra-core, omegaconf,
# antlr4-python3-runtime); the project itself runs from this checkout, not installed.
# Receipts land in OUTDIR/<point>/ as JSON; import them elsewhere with
#   posttrainllm receipt import OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh OUTDIR [WHEELS_DIR|--dry-run] [gpucheck flags]}
shift
if [ "${1:-}" != "" ] && [ -d "$1" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/posttrainllm-site "$1"/*.whl
  export PYTHONPATH="/tmp/posttrainllm-site${PYTHONPATH:+:$PYTHONPATH}"
  shift
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# GPU time needs approval (posttrainllm/lab/approval.py): this prepared script gives it, and gpucheck
# prints its estimate of the device time first.
exec python3 -m posttrainllm.lab.gpucheck "$out" --approve "$@"
