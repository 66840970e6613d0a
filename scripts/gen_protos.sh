#!/usr/bin/env bash
# Generate the Python gRPC code for protos/ into deltaspec/ at the repo root (gitignored).
# Compiled with -I protos so generated modules import by package: `from deltaspec.v1 import ...`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf deltaspec
mkdir -p deltaspec
"${PYTHON:-.venv/bin/python}" -m grpc_tools.protoc -I protos \
    --python_out=. --pyi_out=. --grpc_python_out=. protos/deltaspec/v1/*.proto
