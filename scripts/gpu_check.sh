#!/usr/bin/env bash
# The CUDA checks and GPU timings a session runs when it is lent a GPU machine (one short script, ~10 minutes):
#   bash scripts/gpu_check.sh [OUT_DIR]        # OUT_DIR (default $OUT, else runs/gpu_check) gets logs and JSON
# 1. the tests that skip without CUDA (device placement, codecs on the device, eval/predict --device cuda);
# 2. a short training run on cuda against the same run on cpu (losses and AUC side by side), and on cuda with
#    memory tiers (device caches over host memory and SSD);
# 3. export + serve --device cuda + a short load test (served scores against offline scores);
#    and model-only scoring at batch 2048 on cuda against cpu.
# Each step is bounded by `timeout` and goes on after a failure; the summary at the end says which failed.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { make .venv/.installed >/dev/null && PY=.venv/bin/python; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_check: no CUDA device here; nothing to check" >&2; exit 2; }
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
failed=()
step() {  # step NAME SECONDS COMMAND...: run, log to OUT_DIR/NAME.log, remember a failure
    local name=$1 limit=$2; shift 2
    echo "== $name" >&2
    if ! timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1; then failed+=("$name"); tail -20 "$OUT_DIR/$name.log" >&2; fi
}

step cuda_tests 240 "$PY" -m pytest -q -x -k "cuda or gpu or device" tests/distributed/test_device_placement.py \
    tests/compression/test_compression.py tests/training/test_train.py

for dev in cpu cuda; do
    step "train_$dev" 180 "$PY" -m recstack train --config configs/demo.toml --output-dir "$OUT_DIR/demo_$dev" \
        --overwrite --set train.device="$dev" --set train.max_steps=300 --set train.progress=false
done

# Memory tiers with the caches on the GPU (host- and ssd-cached rows behind device caches): AUC against train_cuda.
step train_cuda_tiers 240 "$PY" -m recstack train --config configs/demo.toml --output-dir "$OUT_DIR/demo_cuda_tiers" \
    --overwrite --set train.device=cuda --set train.max_steps=300 --set train.progress=false \
    --set memory.device=1MB --set memory.host=4MB --set memory.ssd_dir="$OUT_DIR/ssd"

step export 120 "$PY" -m recstack export --checkpoint "$OUT_DIR/demo_cuda" --out "$OUT_DIR/model" --tables int8
step serve_cuda 180 "$PY" - "$OUT_DIR" <<'EOF'
"""recstack serve --device cuda on the exported model: 200 requests, served scores against offline ones."""
import json, subprocess, sys, time
from pathlib import Path

import httpx
import numpy as np

from recstack.serving.model import ServingModel

out = Path(sys.argv[1])
model_dir = out / "model"
offline = ServingModel.load(model_dir, device="cpu")
port = 18080
proc = subprocess.Popen([sys.executable, "-m", "recstack", "serve", str(model_dir), "--port", str(port),
                         "--device", "cuda"])
try:
    for _ in range(120):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    rng = np.random.default_rng(0)
    rows = [{f"I{i + 1}": float(rng.random()) for i in range(13)}
            | {f"C{i + 1}": int(rng.integers(0, 1000)) for i in range(26)} for _ in range(64)]
    want = offline.score(offline.encode(rows, ids=True)).numpy()
    lat = []
    for _ in range(200):
        t0 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/score", json={"rows": rows, "encoded": True,
                                                                  "return_logit": True}, timeout=10)
        lat.append(time.perf_counter() - t0)
        r.raise_for_status()
    got = np.array(r.json()["logits"], dtype=np.float32)
    result = {"max_abs_logit_diff_cuda_vs_cpu": float(np.abs(got - want).max()),
              "p50_ms": 1000 * float(np.median(lat)), "p99_ms": 1000 * float(np.quantile(lat, 0.99))}
    big = offline.encode(rows * 32, ids=True)  # 2048 rows
    for dev in ("cpu", "cuda"):  # model-only samples/s
        m = offline if dev == "cpu" else ServingModel.load(model_dir, device="cuda")
        m.score(big)
        t0 = time.perf_counter()
        for _ in range(20):
            m.score(big)
        result[f"model_only_samples_per_s_{dev}"] = 20 * 2048 / (time.perf_counter() - t0)
    print(json.dumps(result))
    (out / "serve_cuda.json").write_text(json.dumps(result, indent=2))
finally:
    proc.terminate()
    proc.wait(30)
EOF

for dev in cpu cuda cuda_tiers; do  # the runs' final metrics side by side
    [ -f "$OUT_DIR/demo_$dev/summary.json" ] && echo "$dev: $(cat "$OUT_DIR/demo_$dev/summary.json" | tr -d '\n ')"
done > "$OUT_DIR/train_summary.txt"
cat "$OUT_DIR/train_summary.txt" >&2
if [ ${#failed[@]} -gt 0 ]; then echo "gpu_check: failed: ${failed[*]}" >&2; exit 1; fi
echo "gpu_check: all steps passed; results in $OUT_DIR" >&2
