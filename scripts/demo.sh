#!/usr/bin/env bash
# Quick-start command 1: set up, then run the end-to-end demo (report in runs/demo/report.html).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python train.py demo "$@"
