#!/usr/bin/env bash
# The GPU round (issues #23, #41): everything a lent GPU machine should run, by parts.
#
#   ./run gpu-check OUTDIR [PART...]     PART: first second large remote (default: first second)
#
# A session gets 15 minutes of device time in all (the machine's start and every wait included):
# `first` is what matters most, in one call of about 7 minutes; `second` follows at once in the
# same warm machine if the first left 4 minutes or more; `large` and `remote` are for a later
# session. docs/gpu.md says how.
#
# Before the call, here:  ../shared/tools/gpu_wheels.sh && scripts/gpu_round_wheels.sh
#                         (DeepSpeed and its dependencies, pytest-xdist -> .whl/)
# A device call:          GPU_ROUND_BUDGET_S=420 ./run gpu-check "$OUT" first     carry: [".whl"]
#
# Always: the machine's versions, the carried wheels installed into /tmp/site, gockpt._C built
# with the machine's python3 (torch with CUDA). Then, by PART:
#   first   tests/gpu on torch's AdamW fused and foreach (every mode; training unchanged; a killed
#           run resumed; the probe; the never-wrong and partial-replay cases on CUDA), golden
#           vectors recorded afresh from this GPU's Adam/AdamW kernels with every replay profile
#           checked against them, and bench_gpu.py --size 370m: none, the copy-only reference,
#           gockpt-o (K chosen, and K = 4), DCP's async_save with its pinned stager, async-o,
#           async; then gockpt-o-k once more under torch.profiler (trace-gockpt-o-k.txt); before
#           it, bench_pinning.py: what pinning 4 GB on a background thread costs the training
#           thread, four ways
#   second  gockpt's entry points registered (the DeepSpeed FusedAdam adapter), DeepSpeed's
#           op report, its CUDA engines (tests/gpu/test_gpu_deepspeed.py), ZeRO 1 bf16 at 370m
#           (none, native save_checkpoint, the patched one in async-o and gockpt-o), golden
#           vectors of DeepSpeed's FusedAdam, the stored H100 vectors and the CPU never-wrong
#           suite on this machine's build
#   large   experiments/bench_gpu.py --size 2.2b (state 26.5 GB)
#   remote  the remote tier's blocked time, training on the GPU (needs weed in .whl/:
#           scripts/gpu_round_wheels.sh --remote, 48 MB more to carry)
# Every step has a time limit, within GPU_ROUND_BUDGET_S for the whole call (default 570 s: a
# device call may run 600); a step that does not fit is reported as not run. A failing step does
# not stop the next ones, and each writes what it measured as it goes (a cut call still brings
# back its logs, XML reports and the benchmark rows finished so far).
# Everything lands in OUTDIR: one log per step, pytest's XML reports, the benchmarks' JSON and
# markdown, steps.tsv, and report.md (experiments/gpu_report.py) that puts them together.
# The exit status is the number of failed steps.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_round.sh OUTDIR [first] [second] [large] [remote]}
shift
PARTS=" ${*:-first second} "
mkdir -p "$OUT"
DEST=$(cd "$OUT" && pwd)
# A device call brings back 8 files of its $OUT at most: the round writes into a folder of its
# own and DEST gets round.tgz (all of it, packed again after every step: a call cut short still
# brings back what ran), summary.txt and report.md.
OUT=$(mktemp -d /tmp/gpu-round.XXXXXX)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pack() {
    tar czf "$DEST/round.tgz.part" -C "$OUT" . && mv "$DEST/round.tgz.part" "$DEST/round.tgz"
    cp "$OUT/summary.txt" "$DEST/" 2> /dev/null || true
}
BUDGET=${GPU_ROUND_BUDGET_S:-570}
failed=0
printf 'step\trc\tseconds\tlimit\tlast line\n' > "$OUT/steps.tsv"

wants() { [[ $PARTS == *" $1 "* ]]; }

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then
        printf '%s\t-\t-\t-\tnot run: out of time (budget %s s)\n' "$name" "$BUDGET" >> "$OUT/steps.tsv"
        echo "== $name: not run, out of time" | tee -a "$OUT/summary.txt"
        failed=$((failed + 1))
        return
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local last
    last=$(tail -n 1 "$OUT/$name.log" | tr '\t' ' ')
    [ $rc -ne 124 ] || last="timed out after ${limit} s; $last"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" "$last" >> "$OUT/steps.tsv"
    echo "   rc=$rc, $((SECONDS - t0)) s; $last" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
    pack
}

pytest_step() {  # pytest_step NAME LIMIT_S [VAR=VALUE...] PYTEST ARGS...: with an XML report
    local name=$1 limit=$2 vars=()
    shift 2
    while [[ ${1:-} == *=* ]]; do vars+=("$1"); shift; done
    step "$name" "$limit" env "${vars[@]}" python3 -m pytest -q -p no:cacheprovider \
        --junitxml="$OUT/$name.xml" "$@"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" \
    > "$OUT/versions.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
    step wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step build 240 python3 setup.py build_ext --inplace
# gockpt's extensions must import before anything else can run (the H200 machine's toolchain once
# gave a gockpt._C that segfaulted at import). If they do not, the compiler's own libstdc++ is
# preloaded for the rest of the round, and the summary says so.
IMPORT='import gockpt._C, gockpt._tensors, gockpt; print("gockpt imports; isa", gockpt._C.isa())'
step import 60 python3 -c "$IMPORT"
if [ $((BUDGET - SECONDS)) -ge 20 ] && ! python3 -c "$IMPORT" > /dev/null 2>&1; then
    LIBSTDCXX=$(${CXX:-g++} -print-file-name=libstdc++.so.6 2> /dev/null)
    if [ -f "$LIBSTDCXX" ] && LD_PRELOAD=$LIBSTDCXX python3 -c "$IMPORT" > /dev/null 2>&1; then
        export LD_PRELOAD=$LIBSTDCXX
        echo "== import: works with LD_PRELOAD=$LIBSTDCXX (set for the rest of the round)" \
            | tee -a "$OUT/summary.txt"
    fi
fi
# pytest-xdist where carried: the GPU tests in several processes sharing the GPU; pytest-timeout:
# a test that hangs fails alone (with every thread's stack) instead of taking the step's time
PAR=()
python3 -c "import xdist" 2> /dev/null && PAR=(-n 6)
python3 -c "import pytest_timeout" 2> /dev/null && PAR+=(--timeout 120)

if wants first; then
    pytest_step gpu_tests 180 "${PAR[@]}" tests/gpu/test_gpu_checkpoints.py \
        tests/gpu/test_gpu_never_wrong.py tests/capture/test_capture_device.py
    step golden_record 60 python3 experiments/record_golden.py "$OUT/golden-fresh.safetensors"
    pytest_step golden_fresh 60 GOCKPT_GOLDEN="$OUT/golden-fresh.safetensors" \
        tests/replay/test_replay_arithmetic_golden.py
    # what pinning host memory on a background thread costs the training thread, four ways
    step bench_pinning 60 python3 experiments/bench_pinning.py --gb 4 \
        --json "$OUT/bench_pinning.json"
    step bench_370m 420 python3 experiments/bench_gpu.py --size 370m \
        --runs none,reference,gockpt-o,gockpt-o-k,dcp-async,async-o,async --trace gockpt-o-k \
        --run-timeout 90 \
        --json "$OUT/bench_370m.json" --markdown "$OUT/bench_370m.md"
fi
if wants second; then
    # entry points (gockpt.optimizer_adapters) without touching the network or the dependencies
    step install 90 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
    # which DeepSpeed ops this machine can build (its CUDA FusedAdam needs a CUDA compiler)
    step ds_report 60 python3 -m deepspeed.env_report
    pytest_step gpu_deepspeed 300 "${PAR[@]}" tests/gpu/test_gpu_deepspeed.py
    step bench_370m_ds 240 python3 experiments/bench_gpu.py --size 370m \
        --runs ds-none,ds-native,ds-gockpt-o,ds-async-o --run-timeout 120 \
        --json "$OUT/bench_370m_ds.json" --markdown "$OUT/bench_370m_ds.md"
    step golden_record_ds 90 python3 experiments/record_golden.py \
        "$OUT/golden-fresh-ds.safetensors" --deepspeed
    pytest_step golden_fresh_ds 60 GOCKPT_GOLDEN="$OUT/golden-fresh-ds.safetensors" \
        tests/replay/test_replay_arithmetic_golden.py
    pytest_step golden_stored 120 "${PAR[@]}" tests/replay
    pytest_step never_wrong 150 "${PAR[@]}" tests/test_never_wrong.py \
        tests/test_partial_replay.py tests/capture
fi
if wants large; then
    step bench_2.2b 540 python3 experiments/bench_gpu.py --size 2.2b \
        --json "$OUT/bench_2.2b.json" --markdown "$OUT/bench_2.2b.md"
fi
# The remote tier (issue #22): blocked time per checkpoint with it off, on, and on without its
# pause, training on the GPU, SeaweedFS on this machine's other cores.
if wants remote; then
    if [ -x /tmp/site/bin/weed ]; then
        export PATH=/tmp/site/bin:$PATH
        for mode in gockpt-o async-o; do
            step "bench_remote_$mode" 150 python3 experiments/bench_remote_tier.py --blocked-only \
                --device cuda --mode "$mode" --width 2048 --json "$OUT/bench_remote_$mode.json"
        done
    else
        echo "== remote: not run, no weed in .whl/ (scripts/gpu_round_wheels.sh --remote)" \
            | tee -a "$OUT/summary.txt"
    fi
fi
echo "failed steps: $failed" | tee -a "$OUT/summary.txt"
python3 experiments/gpu_report.py "$OUT" > "$OUT/report.log" 2>&1 \
    || echo "report.md not written: see report.log" | tee -a "$OUT/summary.txt"
pack
cp "$OUT/report.md" "$DEST/" 2> /dev/null || true
exit $failed
