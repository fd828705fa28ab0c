"""TensorAwareStateDict: a state whose tensors can be popped, moved to the host and restored.

Follows: NVRx ``TensorAwareStateDict`` / ``BasicTensorAwareStateDict``; difference: CPU tensors are
accepted (NVRx asserts CUDA), and devices are restored to CUDA only when CUDA is available.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BasicTensorAwareStateDict", "TensorAwareStateDict", "TensorPlaceholder"]


@dataclass(frozen=True)
class TensorPlaceholder:
    """What a popped tensor was: shape, dtype and device (as text)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


class TensorAwareStateDict(ABC):
    """A state that exposes its tensors. Implementations must round-trip through ``torch.save``."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True after :meth:`pop_tensors` until :meth:`insert_tensors`/:meth:`init_tensors`."""

    @abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Remove and return every tensor (in a fixed order), leaving placeholders."""

    @abstractmethod
    def insert_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Inverse of :meth:`pop_tensors` (same order)."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Replace placeholders with uninitialized CPU tensors of the recorded shape/dtype."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Swap every tensor for a CPU copy (originals are not modified)."""

    @abstractmethod
    def restore_tensor_device(self) -> None:
        """Move tensors back to the devices they had before :meth:`copy_tensors_to_cpu`."""

    @property
    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Current tensors in pop order (empty while hollow)."""

    @abstractmethod
    def to_state_dict(self) -> Any:
        """The plain nested structure (what is written to disk)."""


def _walk(value: Any, fn) -> Any:
    if isinstance(value, (torch.Tensor, TensorPlaceholder)):
        return fn(value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _walk(v, fn)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_walk(v, fn) for v in value)
    return value


class BasicTensorAwareStateDict(TensorAwareStateDict):
    """Tensors nested in dicts/lists/tuples; CPU or CUDA.

    Args:
        state_dict: the nested state (not copied; tensors are replaced in a new structure).
        devices: original device per tensor (set when loading; default: the tensors' devices).
    """

    def __init__(self, state_dict: Any, devices: list[str] | None = None) -> None:
        self._state = state_dict
        found: list[str] = []
        def note_device(t: torch.Tensor) -> torch.Tensor:
            found.append(str(t.device))
            return t

        _walk(state_dict, note_device)
        self._devices = list(devices) if devices is not None else found

    @property
    def is_hollow(self) -> bool:
        hollow = []
        def note(v: Any) -> Any:
            hollow.append(isinstance(v, TensorPlaceholder))
            return v

        _walk(self._state, note)
        return any(hollow)

    def pop_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []

        def take(t):
            if isinstance(t, TensorPlaceholder):
                return t
            out.append(t)
            return TensorPlaceholder(tuple(t.shape), t.dtype, str(t.device))

        self._state = _walk(self._state, take)
        return out

    def insert_tensors(self, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        self._state = _walk(self._state,
                            lambda v: next(it) if isinstance(v, TensorPlaceholder) else v)

    def init_tensors(self) -> None:
        self._state = _walk(self._state, lambda v: torch.empty(v.shape, dtype=v.dtype)
                            if isinstance(v, TensorPlaceholder) else v)

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        self._state = _walk(self._state, lambda t: t if isinstance(t, TensorPlaceholder)
                            else t.detach().to("cpu", non_blocking=non_blocking, copy=True))
        if non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()

    def restore_tensor_device(self) -> None:
        it = iter(self._devices)

        def move(t):
            device = next(it, "cpu")
            if isinstance(t, TensorPlaceholder):
                return t
            if device.startswith("cuda") and torch.cuda.is_available():
                return t.to(torch.device("cuda", torch.cuda.current_device()))
            return t

        self._state = _walk(self._state, move)

    @property
    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        _walk(self._state, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
        return out

    @property
    def devices(self) -> list[str]:
        return list(self._devices)

    def to_state_dict(self) -> Any:
        return self._state
