"""Fused Triton kernels and their PyTorch references (installed as megatron_dapo.kernels)."""
