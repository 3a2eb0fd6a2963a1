#!/usr/bin/env bash
# The GPU figures in one go (< 10 min on one H100/H200): bf16 train-step MFU at ~1B (flex + compile), the same step in
# transformers' Chameleon side by side, seconds per 512x512 image at the chameleon-7b shape (a hand-written loop),
# and the real sampler there with three-stream guidance, eager against the compiled step (a CUDA graph).
# Arguments go to bench/gpu.py (e.g. --dry-run on CPU, --skip-sampler).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
timeout "${GPU_BENCH_TIMEOUT:-570}" "$python" -m bench.gpu "$@"
# a real run into bench/results also refreshes BENCHMARKS.md (its GPU section reads gpu.json)
case " $* " in
  *" --dry-run "* | *"--results-dir"*) ;;
  *) "$python" -m bench --render-only ;;
esac
