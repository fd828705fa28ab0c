"""The digits data set (scikit-learn's bundled 8x8 images, no download) split once by the parent.

The parent imports scikit-learn once and writes a standardised train/test split to ``data.npz``;
ranks only read that file with numpy, so five rank processes do not each import scikit-learn.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["load_split", "prepare_split"]


def prepare_split(path: str | os.PathLike, seed: int, test_fraction: float = 0.2) -> dict[str, int]:
    """Write the stratified, standardised split of ``load_digits`` to ``path``; returns sizes.

    Features are standardised with the training set's mean and standard deviation (+1 to keep
    the always-zero border pixels finite).

    Raises:
        ConfigError: scikit-learn is missing (install the ``demo`` extra).
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as exc:
        from trainguard.errors import ConfigError

        raise ConfigError(
            "the demo needs scikit-learn for its bundled digits data set: "
            "pip install 'trainguard[demo]'"
        ) from exc
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1.0
    np.savez(
        path,
        x_train=((x_train - mean) / std).astype(np.float32),
        y_train=y_train.astype(np.int64),
        x_test=((x_test - mean) / std).astype(np.float32),
        y_test=y_test.astype(np.int64),
    )
    return {"train": len(y_train), "test": len(y_test), "features": x.shape[1]}


def load_split(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays ``x_train`` (N, 64) float32, ``y_train`` (N,) int64, ``x_test``, ``y_test``."""
    with np.load(path) as data:
        return {k: data[k] for k in ("x_train", "y_train", "x_test", "y_test")}
