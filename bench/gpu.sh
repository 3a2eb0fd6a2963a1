#!/usr/bin/env bash
# The GPU figures in one go (< 10 min on one H100/H200): bf16 train-step MFU at ~1B (flex + compile), the same step in
# transformers' Chameleon side by side, seconds per 512x512 image at the chameleon-7b shape (a hand-written loop),
# and the real sampler there with three-stream guidance, eager against the compiled step (a CUDA graph).
# Arguments go to bench/gpu.py (e.g. --dry-run on CPU, --skip-sampler). Then bench/gpu_fit.py (< 4 min, its own
# GPU_FIT_TIMEOUT): `train.py fit` per family, block and strategy; it gets only --dry-run and --results-dir.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
status=0
timeout "${GPU_BENCH_TIMEOUT:-570}" "$python" -m bench.gpu "$@" || status=$?
# then the real `train.py fit` path per family/block/strategy (bench/gpu_fit.py, < 4 min), under its own limit: its
# failure is reported after bench.gpu's results, never instead of them; it takes only --dry-run and --results-dir
fit_args=()
take_next=0
for arg in "$@"; do
  if [ "$take_next" = 1 ]; then fit_args+=("$arg"); take_next=0; continue; fi
  case "$arg" in
    --dry-run | --results-dir=*) fit_args+=("$arg") ;;
    --results-dir) fit_args+=("$arg"); take_next=1 ;;
  esac
done
fit_status=0
timeout "${GPU_FIT_TIMEOUT:-300}" "$python" -m bench.gpu_fit ${fit_args[@]+"${fit_args[@]}"} || fit_status=$?
[ "$fit_status" -eq 0 ] || echo "gpu.sh: bench.gpu_fit exited $fit_status (bench.gpu: $status)" >&2
# a real run into bench/results also refreshes BENCHMARKS.md (its GPU section reads gpu.json)
case " $* " in
  *" --dry-run "* | *"--results-dir"*) ;;
  *) "$python" -m bench --render-only ;;
esac
[ "$status" -ne 0 ] && exit "$status"
exit "$fit_status"
