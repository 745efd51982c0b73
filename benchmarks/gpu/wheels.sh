#!/usr/bin/env bash
# Wheels the single-GPU check needs beyond a bare GPU image that has torch, transformers, numpy, pyyaml,
# typer, rich, httpx, aiohttp and tokenizers (the device machines': Python 3.12, torch 2.11+cu130), for
# Python 3.12 on x86-64, into .whl/ (git-ignored through .git/info/exclude); run.sh installs them there.
# Run here (where PyPI is reachable), then carry .whl with the check. Versions: the ones pinned for the
# project's own environment (pyproject.toml ranges).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    'torchao==0.18.0' 'pydantic==2.14.4' 'pydantic-core==2.50.5' 'annotated-types==0.8.0' \
    'typing-inspection==0.4.5' 'fastapi==0.150.0' 'starlette==1.10.0' 'uvicorn==0.55.0' \
    'boto3==1.44.8' 'botocore==1.44.8' 's3transfer==0.19.3' 'jmespath==1.1.0'
ls .whl
