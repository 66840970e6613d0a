#!/usr/bin/env bash
# Create .venv at the repo root. torch is installed first with an exact pin: on these
# machines that pin resolves to the local CPU wheel, a range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev]"
