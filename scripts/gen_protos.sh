#!/usr/bin/env bash
# Generate the Python gRPC code for protos/ into deltaspec/v1/ at the repo root (gitignored), with typed
# stubs (.pyi). Compiled with -I protos so generated modules import by package: `from deltaspec.v1 import ...`.
# deltaspec/ itself is committed (the package root: the public names and deltaspec.cli); pyproject.toml maps
# shared/, draft_service/ and target_service/ under it. Only deltaspec/v1/ is generated.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf deltaspec/v1
mkdir -p deltaspec/v1
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos \
    --python_out=. --pyi_out=. --grpc_python_out=. protos/deltaspec/v1/*.proto
echo '"""gRPC messages and stubs generated from protos/deltaspec/v1 by scripts/gen_protos.sh."""' \
    > deltaspec/v1/__init__.py
