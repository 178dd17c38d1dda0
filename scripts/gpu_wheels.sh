#!/usr/bin/env bash
# The Python packages recstack imports that a GPU machine's own Python 3.12 + torch lacks, as cp312 wheels in
# .whl/ (git-ignored), downloaded here, where a registry is reachable; a device call carries .whl and
# scripts/gpu_check.sh installs them there with pip --no-index (the machine reaches no network):
#   bash scripts/gpu_wheels.sh            # then: the device call carries .whl (docs/gpu.md)
# Their own needs (click, h11, anyio, typing-extensions) are in that machine's image already.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=(zstandard==0.25.0 uvicorn==0.55.0 starlette==1.10.0 msgspec==0.23.0)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls -l .whl
