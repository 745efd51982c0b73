#!/usr/bin/env bash
# The single-GPU check of eightfold: at most 8 minutes on one H200 (16 cores), JSON lines into OUTDIR.
#
#   benchmarks/gpu/run.sh OUTDIR            on a machine with one CUDA GPU
#   benchmarks/gpu/run.sh OUTDIR --dry-run  on CPU with tiny shapes: every import and code path (CI runs it:
#                                           tests/benchmarks/test_gpu_dry_run.py)
#
# Writes OUTDIR/results.jsonl (one JSON line per figure, also printed) and OUTDIR/run.log (stderr). The
# parts and their figures: benchmarks/gpu/run.py. Extra arguments go to it (--layers N, --only PART,...).
#
# Needs: the project installed (`make install-test`), or on a bare GPU image with torch (the device
# machines: torch 2.11+cu130, Python 3.12, transformers, no pydantic/fastapi/torchao) the wheels that
# benchmarks/gpu/wheels.sh downloads into .whl/ here, installed there by this script when .whl/ exists.
#
# What one GPU cannot check, and how to run it (also in the header line of results.jsonl):
#   - NCCL process groups and every parallel layout (DDP, ZeRO-1, FSDP2 ZeRO-2/3 and HSDP, TP+SP, PP,
#     CP, EP): python -m benchmarks.parallel_layouts on one node of 8 GPUs (CUDA present: nccl, one GPU
#     per rank, trainer/parallel/mesh.py pick_device);
#   - the seed's 8-GPU layout (dp2 zero1 x tp2 sp x pp2 1f1b): eightfold run configs/seed-1b.yaml on 8 GPUs;
#   - the ZeRO-1 async-save stall and kill-and-restart over NCCL: python -m benchmarks.checkpoint --device cuda;
#   - fp8 under FSDP2 and pipeline parallel: pretrain.precision fp8 with parallel.zero 3 over dp_shard > 1.
set -uo pipefail
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: $0 OUTDIR [--dry-run] [--layers N] [--only PART,...]" >&2
    exit 2
fi
OUTDIR=$1
shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUTDIR"
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
if [ -d "$ROOT/.whl" ] && ! "$PY" -c "import pydantic, torchao" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eightfold-site \
        "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/eightfold-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LIMIT=480
case " $* " in *" --dry-run "*) LIMIT=300 ;; esac
cd "$ROOT" || exit 1
# the whole run is held to its budget; whatever parts finished are already in results.jsonl
timeout --signal=INT --kill-after=20 "$LIMIT" "$PY" -m benchmarks.gpu.run "$OUTDIR" "$@" 2> >(tee "$OUTDIR/run.log" >&2)
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 130 ]; then
    echo "{\"part\": \"end\", \"status\": \"timeout\", \"limit_s\": $LIMIT}" | tee -a "$OUTDIR/results.jsonl"
fi
exit $rc
