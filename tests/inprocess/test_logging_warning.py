"""The "logging is not configured" warning of ``inprocess.Wrapper``: once per job, from rank 0."""

import logging
import warnings

import pytest

from trainguard.inprocess import wrap


@pytest.fixture
def no_logging(monkeypatch):
    """Neither the root logger nor ``trainguard`` has a handler (the root's capture handler, which
    pytest adds at the start of each test phase, is hidden by :func:`_warned`)."""
    monkeypatch.setattr(logging.getLogger("trainguard"), "handlers", [])
    monkeypatch.delenv("TRAINGUARD_LOG_LEVEL", raising=False)


def _warned(monkeypatch, rank: str | None) -> list[str]:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        wrap._warn_if_logging_unconfigured()
    return [str(w.message) for w in got if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("rank", [None, "0"])
def test_rank_zero_or_a_single_process_warns(no_logging, monkeypatch, rank):
    msgs = _warned(monkeypatch, rank)
    assert len(msgs) == 1 and msgs[0].startswith("logging is not configured")


@pytest.mark.parametrize("rank", ["1", "7"])
def test_other_ranks_stay_quiet(no_logging, monkeypatch, rank):
    assert _warned(monkeypatch, rank) == []


def test_configured_logging_is_not_warned_about(no_logging, monkeypatch):
    logging.getLogger("trainguard").handlers.append(logging.NullHandler())
    assert _warned(monkeypatch, "0") == []
    logging.getLogger("trainguard").handlers.clear()
    monkeypatch.setenv("TRAINGUARD_LOG_LEVEL", "INFO")
    assert _warned(monkeypatch, "0") == []
