"""Tests of megatron_dapo.models (and workers.parallel, which builds the groups they take)."""
