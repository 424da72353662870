"""Tests of megatron_dapo.data."""
