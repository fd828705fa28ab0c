"""``AbortTransformerEngine``: release Transformer Engine state when a restart begins.

Follows: NVRx ``abort.AbortTransformerEngine`` (destroy TE's userbuffers, reset its FP8 global
state); difference: without Transformer Engine installed it is a logged no-op instead of an
ImportError inside the monitor thread.
"""

from __future__ import annotations

import importlib.util

from trainguard._core.logging import get_logger
from trainguard.inprocess.abort import Abort
from trainguard.inprocess.state import FrozenState

__all__ = ["AbortTransformerEngine"]

_log = get_logger("trainguard.inprocess")


class AbortTransformerEngine(Abort):
    """Destroy Transformer Engine userbuffers and reset its FP8 state (monitor thread).

    List it to the left of the torch abort in ``Compose`` so the torch abort runs first:
    ``Compose(AbortTransformerEngine(), AbortTorchDistributed())``.

    Without the ``transformer_engine`` package the hook does nothing; constructing it logs one
    WARNING saying so. Errors inside TE are logged, never raised (an abort must not fail).
    Blocks for as long as TE's own teardown takes.
    """

    def __init__(self) -> None:
        self.available = importlib.util.find_spec("transformer_engine") is not None
        if not self.available:
            _log.warning(
                "AbortTransformerEngine: transformer_engine is not installed, so this abort "
                "hook does nothing; remove it from the abort chain or install Transformer Engine"
            )

    def __repr__(self) -> str:
        return "AbortTransformerEngine()"

    def __call__(self, state: FrozenState) -> FrozenState:
        if not self.available:
            return state
        try:
            import transformer_engine.pytorch as te  # type: ignore[import-not-found]

            destroy_ub = getattr(te.module.base, "destroy_ub", None)
            if destroy_ub is not None:
                destroy_ub()
            manager = getattr(te.fp8, "FP8GlobalStateManager", None)
            if manager is not None:
                manager.reset()
        except Exception:  # noqa: BLE001 - an abort hook logs and goes on
            _log.warning("AbortTransformerEngine: Transformer Engine teardown failed",
                         exc_info=True)
        return state
