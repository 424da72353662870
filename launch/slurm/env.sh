# shellcheck shell=bash
# Network and runtime settings for multi-node runs (16 x 8 H800). Sourced by
# launch/slurm/dapo_16x8_h800.sbatch before anything starts; srun passes the environment on to every
# node (--export=ALL is Slurm's default). Pick another file with ENV_FILE=path.
#
# Every setting is overridable: a variable already set in the environment wins over the default here
# (`export NCCL_IB_HCA=mlx5_0,mlx5_3 && sbatch ...`). Settings whose right value depends on the
# cluster's fabric are left unset by default, so NCCL's own detection applies; set them when
# `NCCL_DEBUG=INFO` shows the wrong NIC or transport being picked.

# _default NAME VALUE: export NAME=VALUE unless NAME is already set (even to an empty string, which
# lets a site unset a default by exporting NAME=""). An empty VALUE exports nothing.
_default() {
    if [[ -z "${!1+x}" && -n "$2" ]]; then
        export "$1=$2"
    fi
}

# --- NCCL over InfiniBand / RoCE -------------------------------------------------------------------
# HCAs NCCL may use, e.g. "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7" for the eight
# compute NICs of an H800 node, or "^mlx5_bond_0" to exclude a storage/management NIC. Unset: all.
_default NCCL_IB_HCA ""
# GID index for RoCE v2 (usually 3); leave unset on native InfiniBand.
_default NCCL_IB_GID_INDEX ""
# GPUDirect RDMA: how far apart a GPU and its NIC may be to use it (LOC, PIX, PXB, PHB, SYS).
# Unset: NCCL's topology detection decides. Set "SYS" if GDR is wrongly disabled on your topology.
_default NCCL_NET_GDR_LEVEL ""
# InfiniBand verbs retry timeout (4.096 us * 2^N) and retry count: 22 / 7 ride out the link flaps
# that large jobs see. NCCL's defaults are 20 / 7.
_default NCCL_IB_TIMEOUT 22
_default NCCL_IB_RETRY_CNT 7
# Interfaces for NCCL's bootstrap and socket transport. "^lo,docker" excludes loopback and Docker
# bridges (a leading ^ means "all but"); name the cluster network (e.g. "bond0", "ib0") if needed.
_default NCCL_SOCKET_IFNAME "^lo,docker"
# Gloo (CPU collectives, the rendezvous store's barriers) needs one interface name, not a pattern.
# Unset: gloo resolves the hostname. Set it to the same cluster network as above, e.g. "bond0".
_default GLOO_SOCKET_IFNAME ""
# WARN is quiet; INFO prints the rings/trees and the transport per peer (use it to debug the above).
_default NCCL_DEBUG WARN

# --- PyTorch / Megatron ----------------------------------------------------------------------------
# Megatron's tensor-parallel communication overlap needs kernels issued in order on one hardware
# queue; Megatron-Core asserts this is 1 when TP comm overlap or sequence parallel overlap is on.
_default CUDA_DEVICE_MAX_CONNECTIONS 1
# Free NCCL input tensors when the collective finishes instead of recording them on the stream:
# avoids holding memory until the caching allocator syncs (matters with colocated SGLang).
_default TORCH_NCCL_AVOID_RECORD_STREAMS 1
# Turn a hung collective into an error (and a crash dump) instead of a silent stall.
_default TORCH_NCCL_ASYNC_ERROR_HANDLING 1
# Python output reaches the per-node logs line by line.
_default PYTHONUNBUFFERED 1
# HF tokenizers' thread pool fights the data-loader processes for cores.
_default TOKENIZERS_PARALLELISM false
