#!/usr/bin/env bash
# One round on a lent GPU machine (issue #23), in one device call; everything lands in $OUT.
#
#   here:        ../shared/tools/gpu_wheels.sh            # fills .whl/ (DeepSpeed and its deps)
#                scripts/gpu_remote_wheels.sh             # adds obstore and weed (remote tier)
#   device call: bash scripts/gpu_round.sh                # carry: [".whl"]
#
# Builds gockpt._C with the machine's python3 (torch with CUDA), installs the DeepSpeed wheels
# into /tmp/site, registers gockpt's entry points (the DeepSpeed FusedAdam adapter is found
# through them), then runs, each with its own log: the CUDA tests (tests/gpu: every mode on
# torch's AdamW, the probe, a killed run resumed, DeepSpeed's engines incl. its own CUDA
# FusedAdam with its moments replayed and parameters copied at F), the golden replay tests,
# the never-wrong and partial-replay tests, the side-by-side benchmark on the GPU, and the
# remote tier's blocked time (when weed was carried).
# A failing step does not stop the next ones; the exit status is the number of failed steps.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
failed=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, count a failure
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc, $((SECONDS - t0)) s; last line: $(tail -n 1 "$OUT/$name.log")" \
        | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(0))" > "$OUT/versions.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
    step wheels python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step build python3 setup.py build_ext --inplace
# entry points (gockpt.optimizer_adapters) without touching the network or the dependencies
step install python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
step gpu_tests python3 -m pytest -q -p no:cacheprovider -x tests/gpu
step golden python3 -m pytest -q -p no:cacheprovider tests/replay
step never_wrong python3 -m pytest -q -p no:cacheprovider tests/test_never_wrong.py \
    tests/test_partial_replay.py tests/capture
step bench_gpu python3 experiments/bench_gpu.py --json "$OUT/bench_gpu.json"
# The remote tier (issue #22): blocked time per checkpoint with it off, on, and on without its
# pause, training on the GPU, SeaweedFS on this machine's other cores (scripts/gpu_remote_wheels.sh
# carries obstore and weed in .whl/).
if [ -x /tmp/site/bin/weed ]; then
    export PATH=/tmp/site/bin:$PATH
    for mode in gockpt-o async-o; do
        step "bench_remote_$mode" python3 experiments/bench_remote_tier.py --blocked-only \
            --device cuda --mode "$mode" --width 2048 --json "$OUT/bench_remote_$mode.json"
    done
fi
echo "failed steps: $failed" | tee -a "$OUT/summary.txt"
exit $failed
