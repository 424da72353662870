#!/usr/bin/env bash
# Submit a recipe as a Ray job, the way the DAPO recipe reproduces its runs:
#
#   export RAY_ADDRESS="http://${RAY_IP:-localhost}:8265"   # the cluster's dashboard (job server)
#   export WORKING_DIR="${PWD}"                              # packed and shipped to the cluster
#   export RUNTIME_ENV="launch/runtime_env.yaml"             # environment variables, pip packages
#   launch/ray_job.sh configs/dapo_qwen2.5_32b.yaml [key=value ...]
#   launch/ray_job.sh --dry-run configs/...                  # print the command only (or DRY_RUN=1)
#
# The job runs `$PYTHON -m megatron_dapo.ray_launch --config <recipe> [key=value ...]` in the unpacked
# working directory: it starts the recipe's world, trainer.nnodes x trainer.n_gpus_per_node ranks, as one
# torchrun agent per node placed by Ray (one placement-group bundle per node, the node's GPUs in it), and
# the trainer places its engines on the same cluster. `ray job submit` follows the job's log and exits
# non-zero when the job fails (with the first failing node's status).
# Relative paths in a recipe resolve inside the unpacked working directory. data/ (the output of
# `make data`, a few MB) travels with it; models/ is excluded by launch/runtime_env.yaml (a 32B
# checkpoint cannot travel in a Ray package, limit 512 MiB), so point the model at shared storage:
#   launch/ray_job.sh configs/dapo_qwen2.5_32b.yaml \
#     model.hf_path=/shared/models/Qwen2.5-32B data.tokenizer=/shared/models/Qwen2.5-32B
# Overridable: RAY (the ray CLI, default ray), PYTHON (the job's interpreter, default python),
# RAY_JOB_SUBMIT_ARGS (extra `ray job submit` flags, e.g. "--no-wait" or "--submission-id x").
set -euo pipefail

usage() {  # the comment block at the top of this script
    sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | grep '^#' | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//' | sed '/./,$!d'
}
die() { echo "ray_job.sh: $*" >&2; exit 2; }

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY_RUN=${DRY_RUN:-0}
ARGS=()
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        *) ARGS+=("$arg") ;;
    esac
done
(( ${#ARGS[@]} >= 1 )) || die "usage: launch/ray_job.sh [--dry-run] <recipe.yaml> [key=value ...]"
RECIPE=${ARGS[0]}
OVERRIDES=("${ARGS[@]:1}")

RAY_ADDRESS=${RAY_ADDRESS:-http://${RAY_IP:-localhost}:8265}
WORKING_DIR=${WORKING_DIR:-$REPO_DIR}
RUNTIME_ENV=${RUNTIME_ENV:-$REPO_DIR/launch/runtime_env.yaml}
[[ -d "$WORKING_DIR" ]] || die "WORKING_DIR=$WORKING_DIR is not a directory"
[[ -f "$RUNTIME_ENV" ]] || die "RUNTIME_ENV=$RUNTIME_ENV not found"
# The recipe path travels as written and is read inside the unpacked working directory.
[[ -f "$WORKING_DIR/$RECIPE" ]] || die "recipe $RECIPE not found under WORKING_DIR=$WORKING_DIR (give it relative to WORKING_DIR)"

# Ray runs the job in a temporary copy of WORKING_DIR on each node: a relative output directory would leave
# the checkpoints and TensorBoard files there (docs/cluster.md).
OUTPUT_DIR=$(sed -n 's/^[[:space:]]*output_dir:[[:space:]]*//p' "$WORKING_DIR/$RECIPE" | head -n 1)
for o in "${OVERRIDES[@]}"; do
    case "$o" in trainer.output_dir=*) OUTPUT_DIR=${o#trainer.output_dir=} ;; esac
done
if [[ "${OUTPUT_DIR:-runs}" != /* ]]; then
    echo "ray_job.sh: trainer.output_dir=${OUTPUT_DIR:-runs} is relative: checkpoints and TensorBoard files would" \
         "stay in each node's temporary copy of WORKING_DIR; give trainer.output_dir=/path/on/shared/storage" >&2
fi

read -r -a EXTRA <<<"${RAY_JOB_SUBMIT_ARGS:-}"
cmd=("${RAY:-ray}" job submit --address "$RAY_ADDRESS" --runtime-env "$RUNTIME_ENV" --working-dir "$WORKING_DIR"
     "${EXTRA[@]}" -- "${PYTHON:-python}" -m megatron_dapo.ray_launch --config "$RECIPE" "${OVERRIDES[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
