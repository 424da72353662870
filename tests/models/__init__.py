"""Tests of megatron_dapo.models (and megatron_dapo.parallel, which builds the groups they take)."""
