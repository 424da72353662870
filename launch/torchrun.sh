#!/usr/bin/env bash
# One node: torchrun with a standalone (loopback) rendezvous, one rank per GPU.
#
#   launch/torchrun.sh --config configs/<recipe>.yaml [key=value ...]
#   NPROC=2 launch/torchrun.sh --config configs/tiny_cpu.yaml        # 2 CPU ranks (gloo)
#   launch/torchrun.sh --dry-run --config ...                          # print the command only
#
# NPROC: ranks on this node; default the number of GPUs `nvidia-smi -L` lists, or 1 without GPUs.
# It also sets trainer.nnodes=1 and trainer.n_gpus_per_node=NPROC, so the config always matches
# the launch (passing those two keys yourself is an error). TORCHRUN picks the launcher (default:
# `python -m megatron_dapo.torchrun`, torchrun whose stores listen on the address they are given, here
# loopback; PYTHON picks the interpreter). Every socket of the run listens on loopback: the stores, and the
# ranks' gloo / NCCL bootstrap sockets (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME default to lo).
# Also DRY_RUN=1 for --dry-run.
set -euo pipefail

usage() {  # the comment block at the top of this script
    sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | grep '^#' | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//' | sed '/./,$!d'
}
die() { echo "torchrun.sh: $*" >&2; exit 2; }

DRY_RUN=${DRY_RUN:-0}
ARGS=()
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1 ;;
        trainer.nnodes=*|trainer.n_gpus_per_node=*) die "$arg: set by this script from NPROC (one node)" ;;
        *) ARGS+=("$arg") ;;
    esac
done

if [[ -z "${NPROC:-}" ]]; then
    NPROC=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
        if (( gpus > 0 )); then NPROC=$gpus; fi
    fi
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$NPROC'"

if [[ -n "${TORCHRUN:-}" ]]; then launcher=("$TORCHRUN"); else launcher=("${PYTHON:-python}" -m megatron_dapo.torchrun); fi
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
# The overrides go after the user's arguments: `--config X k=v` stays one option plus positionals.
cmd=("${launcher[@]}" --standalone --local-addr=127.0.0.1 --nnodes=1 --nproc_per_node="$NPROC"
     -m megatron_dapo.train "${ARGS[@]}" trainer.nnodes=1 trainer.n_gpus_per_node="$NPROC")
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
