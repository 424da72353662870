"""megatron_dapo: a Megatron-Core based DAPO reinforcement-learning trainer.

Import is cheap and GPU-free: heavy modules (megatron.core, triton, sglang, ray) are
imported lazily by the parts that need them.
"""

__version__ = "0.1.0"
