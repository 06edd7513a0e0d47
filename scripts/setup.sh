#!/usr/bin/env bash
# Create .venv and install packdata with its test tools.
# torch is pinned here, and installed first, to the CPU build that lies on this
# machine's disk; the project itself only asks for torch>=2.1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,plot,ray,turbo]"
