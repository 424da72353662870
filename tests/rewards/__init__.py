"""Tests of megatron_dapo.rewards."""
