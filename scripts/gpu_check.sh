#!/usr/bin/env bash
# The device check: one command of under 7 minutes that a GPU machine runs the first time it is lent
# (docs/gpu.md says what each step proves and how to read the results):
#   bash scripts/gpu_check.sh [OUT_DIR]                           # on the GPU machine (OUT_DIR default $OUT)
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh /tmp/rehearsal # the same steps on the CPU (the rehearsal)
# It runs on the machine's own python3 and torch (PY= to choose another; here .venv's when there is one), with
# PYTHONPATH=. and the C extension built in place (or skipped: recstack then runs its numpy loops), and installs
# the wheels of .whl/ (scripts/gpu_wheels.sh) with pip --no-index: it never reaches a network and never runs
# make. Each step is bounded by `timeout` and writes one JSON line to OUT_DIR/results.jsonl; the step logs go
# to OUT_DIR/steps.log; everything else stays under GPU_CHECK_WORK (default /tmp/gpu_check).
set -u
cd "$(dirname "$0")/.."
DEV=${GPU_CHECK_DEVICE:-cuda}
OUT_DIR=${1:-${OUT:-/tmp/gpu_check_out}}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT_DIR" || exit 2
: > "$OUT_DIR/results.jsonl"
LOG="$OUT_DIR/steps.log"
: > "$LOG"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl \
        >> "$LOG" 2>&1 && export PYTHONPATH=$PWD:$WORK/site
fi
# The eb codec's C loops, built in place for this Python (optional: without a compiler, recstack's numpy loops).
timeout 30 "$PY" setup.py -q build_ext --inplace --build-temp "$WORK/build" >> "$LOG" 2>&1 \
    || echo "gpu_check: C extension not built; the numpy loops run" >> "$LOG"
[ "$DEV" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1

step() {  # step NAME SECONDS: run it bounded; a step killed or crashed before writing its line gets one here
    local name=$1 limit=$2 t0=$SECONDS rc
    echo "== $name ($DEV, at most ${limit}s)" | tee -a "$LOG" >&2
    timeout -k 5 "$limit" "$PY" scripts/gpu_check.py "$name" --device "$DEV" --work "$WORK" --out "$OUT_DIR" \
        >> "$LOG" 2>&1
    rc=$?
    grep -q "\"step\": \"$name\"" "$OUT_DIR/results.jsonl" || "$PY" scripts/gpu_check.py record "$name" \
        "exited $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')" --out "$OUT_DIR" \
        --work "$WORK" >> "$LOG" 2>&1
    tail -1 "$OUT_DIR/results.jsonl" | cut -c1-300 >&2
}
# Bounds: 380 s in all on a GPU (+30 s of build: under the 7 minutes of the check). The CPU rehearsal gets
# GPU_CHECK_SCALE x each (default 2: the same runs on a 2-core machine; more where that machine is loaded).
SCALE=${GPU_CHECK_SCALE:-$([ "$DEV" = cpu ] && echo 2 || echo 1)}
scale() { echo $(($1 * SCALE)); }
step env "$(scale 25)"
step parity "$(scale 40)"
step cuda_tests "$(scale 70)"
step two_ranks "$(scale 100)"
step tiers "$(scale 40)"
step serve "$(scale 50)"
step throughput "$(scale 55)"
failed=$(grep -c '"status": "fail"' "$OUT_DIR/results.jsonl")
echo "gpu_check: $DEV: $(grep -c '"status": "pass"' "$OUT_DIR/results.jsonl") steps passed, $failed failed," \
    "${SECONDS}s; $OUT_DIR/results.jsonl" | tee -a "$LOG" >&2
[ "$failed" = 0 ]
