#!/usr/bin/env bash
# Generate the Python gRPC code for protos/ into deltaspec/v1/ at the repo root (gitignored), with typed
# stubs (.pyi). Compiled with -I protos so generated modules import by package: `from deltaspec.v1 import ...`.
# deltaspec/ is the root of the installed namespace; pyproject.toml maps shared/, draft_service/ and
# target_service/ under it.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf deltaspec
mkdir -p deltaspec/v1
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos \
    --python_out=. --pyi_out=. --grpc_python_out=. protos/deltaspec/v1/*.proto
echo '"""deltaspec: exact speculative decoding for hybrid GDN + attention models (generated package root)."""' \
    > deltaspec/__init__.py
echo '"""gRPC messages and stubs generated from protos/deltaspec/v1 by scripts/gen_protos.sh."""' \
    > deltaspec/v1/__init__.py
