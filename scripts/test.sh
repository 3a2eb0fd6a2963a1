#!/usr/bin/env bash
# Quick-start command 2: set up, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest "$@"
