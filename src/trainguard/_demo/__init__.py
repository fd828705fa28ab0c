"""``trainguard demo``: the project's end-to-end demonstration of in-process restart.

Private package: the command line (``trainguard demo``) is its interface. Modules: ``cli``
(arguments), ``_launch``/``_progress`` (parent), ``_rank``/``_train``/``_faults`` (ranks),
``_events`` (JSONL logs), ``_report``/``_timeline`` (summary, table, picture).
"""

__all__: list[str] = []
