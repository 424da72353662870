#!/usr/bin/env bash
# Everything worth knowing from one short lease of a GPU, in one command (about 8 minutes at most).
#
#   bash tests/gpu/run_all.sh          # on the GPU machine, from a checkout with .gpu-wheels/ beside it
#   bash tests/gpu/run_all.sh --dry    # (or DRY=1) on a CPU: every step at tiny sizes, the same JSON
#
# Steps, each under its own `timeout`; one that fails or times out is recorded and the next still runs:
#   wheels          tools/gpu_wheels.py check: .gpu-wheels/ holds exactly tests/gpu/wheels.txt, for cp312
#   install         GPU: pip install --no-index --target (the machine has no network; PYTHONPATH gets it)
#                   dry: pip's --dry-run for CPython 3.12 on manylinux x86_64
#   env             tests/gpu/gpu_env.py: versions, the GPU, measured matmul TFLOP/s and copy GB/s
#   ipc             tests/gpu/ipc_bandwidth.py: CUDA IPC weight transport between two processes, GB/s and
#                   checksums (dry: CPU shared memory)
#   fused_vs_eager  tests/gpu/fused_vs_eager.py: the Triton log-prob/entropy and clipped-loss kernels
#                   against the eager path, time and peak memory (dry: Triton's interpreter, tiny shapes)
#   mfu             tests/gpu/mfu_1b.py: a ~1B Megatron GPT's training step, tokens/s and MFU (dry: tiny, CPU)
#   pytest          pytest -m gpu tests/gpu (dry: tests/gpu is collected and skipped, and the Triton tests
#                   of tests/kernels/test_clipped_loss.py run in Triton's interpreter)
# Then $OUT/gpu_figures.json (tests/gpu/collect_figures.py: every step's status, duration and figures,
# with the environment) and $OUT/run_all.log (every step's full output). Exit 0 when every step is ok.
#
# Environment: OUT (default outputs/gpu_run_all), BUDGET_S (seconds for all steps, default 480),
# GPU_WHEELS (default .gpu-wheels), PYTHON (default python3; dry: .venv/bin/python when present).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
DRY=${DRY:-0}
for arg in "$@"; do
    case $arg in
        --dry) DRY=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run_all.sh: unknown argument $arg (expected --dry)" >&2; exit 2 ;;
    esac
done
[[ $DRY == 0 || $DRY == 1 ]] || { echo "run_all.sh: DRY must be 0 or 1, got $DRY" >&2; exit 2; }

OUT=${OUT:-$REPO/outputs/gpu_run_all}
BUDGET_S=${BUDGET_S:-480}
WHEELS=${GPU_WHEELS:-$REPO/.gpu-wheels}
RESERVE_S=10  # kept back from the budget for writing the figures
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ $DRY == 1 && -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python
fi
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d) || exit 2
trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/run_all.log
: >"$LOG"

export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [[ $DRY == 1 ]]; then
    MODE=dry TINY=(--tiny)
    # the CPU's view even on a GPU machine: no device, the kernels in Triton's interpreter
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    INSTALL=(--dry-run)
    # one kernel file proves the step (the suite runs every kernel test in the interpreter anyway)
    PYTEST=(tests/gpu tests/kernels/test_clipped_loss.py -k "gpu or triton")
else
    MODE=gpu TINY=()
    unset TRITON_INTERPRET  # the GPU steps measure compiled kernels
    SITE=/tmp/megatron_dapo_site  # the carried wheels, installed where the image's packages stay untouched
    export PYTHONPATH=$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
    INSTALL=(--target "$SITE")
    PYTEST=(-m gpu tests/gpu)
fi

log() { printf '%s\n' "$*" | tee -a "$LOG"; }

# run_step NAME CAP_S COMMAND...: run under `timeout` for CAP_S seconds or what is left of the budget;
# stderr goes to the log as it comes, stdout to $WORK/NAME.out (a figure's JSON is its last line) and
# then to the log.
run_step() {
    local name=$1 cap=$2 limit status rc start end
    shift 2
    limit=$((BUDGET_S - RESERVE_S - SECONDS))
    ((cap < limit)) && limit=$cap
    start=$EPOCHREALTIME
    if ((limit < 5)); then
        printf '%s\tskipped\t\t%s\t%s\t%s\n' "$name" "$start" "$start" 0 >>"$WORK/steps.tsv"
        log "== $name: skipped, the ${BUDGET_S} s budget is spent"
        return
    fi
    printf '\n== %s (limit %s s): %s\n' "$name" "$limit" "$*" >>"$LOG"
    timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.out" 2>>"$LOG"
    rc=$?
    end=$EPOCHREALTIME
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    { echo "-- stdout"; cat "$WORK/$name.out"; } >>"$LOG"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$start" "$end" "$limit" >>"$WORK/steps.tsv"
    log "== $name: $status (exit $rc) after $((${end%.*} - ${start%.*})) s"
}

log "run_all.sh: mode $MODE, $(date -u +%FT%TZ), python $PYTHON, budget ${BUDGET_S} s, out $OUT"
run_step wheels 30 "$PYTHON" tools/gpu_wheels.py check --dir "$WHEELS"
run_step install 60 "$PYTHON" tools/gpu_wheels.py install --dir "$WHEELS" "${INSTALL[@]}"
run_step env 60 "$PYTHON" tests/gpu/gpu_env.py "${TINY[@]}"
run_step ipc 90 "$PYTHON" tests/gpu/ipc_bandwidth.py "${TINY[@]}"
run_step fused_vs_eager 150 "$PYTHON" tests/gpu/fused_vs_eager.py "${TINY[@]}"
run_step mfu 180 "$PYTHON" tests/gpu/mfu_1b.py "${TINY[@]}"
run_step pytest 300 "$PYTHON" -m pytest -v -p no:cacheprovider "${PYTEST[@]}"

"$PYTHON" tests/gpu/collect_figures.py --work "$WORK" --mode "$MODE" --budget-s "$BUDGET_S" \
    --out "$OUT/gpu_figures.json" 2>&1 | tee -a "$LOG"
python_rc=${PIPESTATUS[0]}
((python_rc == 0)) || { log "collect_figures.py failed (exit $python_rc)"; exit 1; }
"$PYTHON" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/gpu_figures.json"
