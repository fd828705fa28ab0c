"""trainguard: keep PyTorch distributed training and multi-process inference running through
failures.

Capabilities live in subpackages (``inprocess``, ``fault_tolerance``, ``checkpointing``,
``straggler``, ``attribution``, ``runner``, ``integrations.lightning``); each is imported on
demand so ``import trainguard`` stays cheap.
"""

from trainguard.errors import ConfigError, TrainguardError, TrainguardTimeout

__version__ = "0.1.0"
__all__ = ["ConfigError", "TrainguardError", "TrainguardTimeout", "__version__"]
