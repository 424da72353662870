"""megatron_dapo: a Megatron-Core based DAPO reinforcement-learning trainer.

Import is cheap and GPU-free: heavy modules (megatron.core, triton, sglang, ray) are
imported lazily by the parts that need them, and Megatron-Core's own import is made lean
(`mcore_import`: about 2 s less per process).
"""

from megatron_dapo import mcore_import as _mcore_import

_mcore_import.install()

__version__ = "0.1.0"
