#!/usr/bin/env bash
# Adds to ./.whl/ what the GPU round runs its tests with beyond the lent machine's own python3:
# pytest-xdist, execnet and pytest-timeout (pure Python, about 100 KB): the GPU tests run in
# several processes sharing the GPU, and a test that hangs fails alone, with its threads'
# stacks. Run after ../shared/tools/gpu_wheels.sh (which empties .whl/):
#   ../shared/tools/gpu_wheels.sh && scripts/gpu_round_wheels.sh
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
    -d .whl "pytest-xdist>=3.5,<4" "execnet>=2.1,<3" "pytest-timeout>=2.3,<3"
du -sh .whl
