#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine (`bash scripts/gpu_check.sh` from anywhere in the repo):
#   1. wheels: carried gRPC/protobuf/OpenTelemetry wheels (.whl/, see below) into /tmp/site; versions, nvidia-smi,
#      and an import of the generated deltaspec/v1 modules (their grpcio/protobuf version checks);
#   2. pytest: tests/test_triton_kernel.py and tests/test_triton_commit.py (the Triton kernels compiled for the
#      GPU against the naive loop and the torch commit) and
#      tests/test_cuda.py (models, state, decoding loop and served models on CUDA against the CPU);
#   3. bench: `deltaspec bench --only gpu --quick` (Qwen3.5 shapes at their real sizes with random bf16 weights:
#      passes against the floor the copy bandwidth sets, HF generate() on the same weights, up to 256 sessions
#      with and without speculation, within its own 150 s budget; then the load table with both servers on CUDA,
#      and eager against captured and compiled generations of the embedded pair on the GPU);
#   4. pipeline: pipelined vs serial rounds at 1 and 5 ms on the machine's cores (CPU models, a core per service).
# Each step has a time limit (all of them together at most $GPU_CHECK_BUDGET_S, default 540 s) and a failing step
# does not stop the next. Logs go to $OUT (a temporary directory when unset): env.txt, pytest.log, junit.xml,
# bench_gpu.log, bench_gpu.json, pipeline.log, summary.txt. Exit status 1 when any step failed.
#
# The machine's python3 has torch and triton but maybe not this repo's grpcio/protobuf/OpenTelemetry: carry them
# as cp312 wheels in the git-ignored .whl/ (see the device README), with the generated, git-ignored deltaspec/.
# Locally: SKIP_WHEELS=1 PYTHON=.venv/bin/python bash scripts/gpu_check.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-540}
START=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
SUMMARY=()
FAILED=0

note() {  # note STEP STATUS [DETAIL]
    SUMMARY+=("$(printf '%-7s %-7s %4ds  %s' "$1" "$2" "$((SECONDS - STEP_START))" "${3:-}")")
    [[ $2 == ok ]] || FAILED=1
}

limit() {  # seconds a step may take: at most $1, and what is left of the budget
    local left=$((BUDGET - (SECONDS - START)))
    echo $((left < $1 ? left : $1))
}

run() {  # run LOG LIMIT CMD...: CMD under `timeout` (its whole process group), output shown and appended to LOG
    local log=$1 t=$2
    shift 2
    if ((t < 15)); then
        echo "not run: the time budget (${BUDGET}s) is spent" | tee -a "$log"
        return 124
    fi
    echo "\$ $* (at most ${t}s)" | tee -a "$log"
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [[ $rc == 124 || $rc == 137 ]] && echo "TIMED OUT after ${t}s" | tee -a "$log"
    return "$rc"
}

status() {  # ok, or why not, from an exit status
    case $1 in 0) echo ok ;; 124 | 137) echo "TIMEOUT" ;; *) echo "FAIL" ;; esac
}

# ---- 1. wheels and environment ----
STEP_START=$SECONDS
echo "=== 1. wheels and environment"
if [[ ${SKIP_WHEELS:-0} == 1 ]]; then
    wheels="skipped (SKIP_WHEELS=1)"
elif compgen -G ".whl/*.whl" >/dev/null; then
    if timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site
        wheels="$(ls .whl/*.whl | wc -l) wheels installed into /tmp/site"
    else
        wheels="FAILED to install .whl/*.whl"
    fi
else
    wheels="none in .whl/"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$REPO"
{
    echo "wheels: $wheels"
    echo "PYTHONPATH=$PYTHONPATH"
    timeout 20 nvidia-smi || echo "nvidia-smi: not available"
    timeout 90 "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
bad = 0
for name in ("triton", "grpc", "google.protobuf", "opentelemetry.sdk", "opentelemetry.instrumentation.grpc",
             "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "grpc_health.v1.health", "grpc_reflection",
             "grpc_status", "deltaspec.v1.target_service_pb2_grpc", "deltaspec.v1.draft_service_pb2_grpc",
             "deltaspec.shared.rpc.server"):
    try:
        module = importlib.import_module(name)
        version = getattr(module, "__version__", "")
        print(f"import {name}: ok {version} {getattr(module, '__file__', '')}")
    except Exception as e:  # noqa: BLE001 - each import reported, all tried
        bad += 1
        print(f"import {name}: FAILED {type(e).__name__}: {e}")
from importlib.metadata import version
for dist in ("grpcio", "protobuf", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-instrumentation-grpc"):
    try:
        print(f"{dist} {version(dist)}")
    except Exception as e:  # noqa: BLE001
        print(f"{dist}: {e}")
sys.exit(1 if bad or not torch.cuda.is_available() else 0)
EOF
} 2>&1 | tee "$OUT/env.txt"
rc=${PIPESTATUS[0]}
if [[ $wheels == FAILED* ]]; then
    note env FAIL "$wheels"
elif [[ $rc != 0 ]]; then
    note env FAIL "$wheels; an import failed or no CUDA: see env.txt"
else
    note env ok "$wheels"
fi
HAVE_CUDA=$(timeout 30 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# ---- 2. tests ----
STEP_START=$SECONDS
echo "=== 2. pytest"
t=$(limit 240)
run "$OUT/pytest.log" "$t" "$PY" -m pytest -p no:cacheprovider -rfEsxX --timeout 150 --durations 10 \
    --junitxml "$OUT/junit.xml" tests/test_triton_*.py tests/test_cuda.py
rc=$?
line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)|^=+ .*(passed|failed|error|no tests ran)' \
    "$OUT/pytest.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
if [[ $HAVE_CUDA != 1 && $rc == 0 ]]; then
    note pytest FAIL "no CUDA: the GPU tests were skipped (${line})"
else
    note pytest "$(status $rc)" "${line:-see pytest.log}"
fi

# ---- 3. the bench's gpu section ----
STEP_START=$SECONDS
echo "=== 3. bench --only gpu --quick"
if [[ $HAVE_CUDA != 1 ]]; then
    echo "no CUDA device (torch.cuda.is_available() is False): the bench's gpu section cannot run" |
        tee "$OUT/bench_gpu.log"
    note bench FAIL "no CUDA device"
else
    t=$(limit 300)
    # stdout (one JSON object) to bench_gpu.json; progress, server logs and errors to bench_gpu.log
    run "$OUT/bench_gpu.log" "$t" bash -c '"$1" -m deltaspec.shared.cli bench --only gpu --quick --json >"$2"' \
        bench "$PY" "$OUT/bench_gpu.json"
    rc=$?
    if [[ $rc == 0 ]]; then
        timeout 60 "$PY" - "$OUT/bench_gpu.json" <<'EOF' 2>&1 | tee -a "$OUT/bench_gpu.log"
import json, sys
from benchmarks.suite import print_tables
result = json.load(open(sys.argv[1]))
if "gpu" not in result:
    sys.exit("the result has no gpu section")
print_tables(result)
EOF
        rc=${PIPESTATUS[0]}
        shapes=$(sed -n 's/^GPU summary: //p' "$OUT/bench_gpu.log" | paste -sd ';' -)
        note bench "$(status $rc)" "$shapes"
    else
        note bench "$(status $rc)" "exit $rc: see bench_gpu.log"
    fi
fi

# ---- 4. the pipeline bench on this machine's cores (CPU models; a core for each service, more for the client) ----
STEP_START=$SECONDS
echo "=== 4. pipelined vs serial rounds at 1 and 5 ms (benchmarks.pipeline, one repeat)"
t=$(limit 200)
run "$OUT/pipeline.log" "$t" "$PY" -c "import torch; torch.set_num_threads(1); from benchmarks import pipeline; \
pipeline.print_rows(pipeline.compare(delays_ms=(1, 5), repeats=1))"
rc=$?
note pipeline "$(status $rc)" "$(awk '$2 ~ /^(client|server)$/ && $6 ~ /^[0-9]+$/ {printf "%s ms %s %sx; ", $1, $2, $5}' \
    "$OUT/pipeline.log")"

# ---- summary ----
{
    echo "=== summary ($((SECONDS - START)) s; logs in $OUT)"
    printf '%s\n' "${SUMMARY[@]}"
    grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" 2>/dev/null | head -20
} | tee "$OUT/summary.txt"
exit "$FAILED"
