#!/usr/bin/env bash
# Create .venv at the repo root. torch is installed first with an exact pin: on these
# machines that pin resolves to the local CPU wheel, a range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
# The editable install maps deltaspec/v1/, which gen_protos.sh fills below: it must exist first.
mkdir -p deltaspec/v1
.venv/bin/pip install -q -e ".[dev]"
# gRPC code is generated from protos/, then the editable install is redone so it maps deltaspec/v1/.
bash scripts/gen_protos.sh
.venv/bin/pip install -q --no-deps -e .
# buf lints protos/ in the tests; it is an npm package (skip quietly where npm is missing).
if command -v npm >/dev/null; then npm install --loglevel=error --no-fund --no-audit --prefix .venv/buf @bufbuild/buf; fi
# kubectl renders deploy/k8s in the tests (it ships kustomize); Debian packages it. Where apt or root
# is missing the deploy tests that need it skip and say why.
if ! command -v kubectl >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && apt-get install -y -qq kubectl >/dev/null; } || echo "setup: could not install kubectl" >&2
fi
