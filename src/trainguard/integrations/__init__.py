"""Integrations of trainguard's capabilities into training frameworks.

* :mod:`trainguard.integrations.lightning` - Lightning (``lightning`` namespace) callbacks and
  plugins; :mod:`trainguard.integrations.lightning.pl` - the same for ``pytorch_lightning``.
  Install with ``pip install 'trainguard[lightning]'``.

Importing this package imports no framework.
"""

__all__: list[str] = []
