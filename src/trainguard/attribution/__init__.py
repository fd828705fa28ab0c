"""Failure attribution: what failed, where, whose fault, and whether a restart can help.

* :func:`analyze` - the one pipeline (logs and/or flight-recorder dumps -> decision record) used
  by ``trainguard analyze``, the service and the launcher.
* :func:`analyze_logs` - streaming, registry-driven log analysis (``patterns/default.yaml``).
* :func:`analyze_flight_recorder` - PyTorch flight-recorder dumps, loaded without running code.
* :func:`decide` / :class:`RestartPolicy` - the restart agent (history, retry budget).
* :class:`JsonlPoster`, :class:`WebhookPoster`, :class:`SlackPoster` - result posting.
* :func:`create_app` / :class:`ServiceConfig` / :class:`AttributionClient` - the HTTP service.
"""

from trainguard.attribution._agent import AgentDecision, RestartPolicy, decide, load_history
from trainguard.attribution._analyze import analyze_logs
from trainguard.attribution._client import AttributionClient
from trainguard.attribution._flight_recorder import FlightRecorderReport, analyze_flight_recorder
from trainguard.attribution._pipeline import JOB_ENDED_DEFAULT, analyze
from trainguard.attribution._posting import JsonlPoster, SlackPoster, WebhookPoster
from trainguard.attribution._registry import CATEGORIES, load_registry
from trainguard.attribution._result import AnalysisResult, Cascade, Evidence
from trainguard.attribution._store import ResultStore
from trainguard.attribution._svc_core import ServiceConfig
from trainguard.attribution.errors import (
    AttributionError,
    FlightRecorderError,
    LogInputError,
    ServiceError,
)


def create_app(cfg: ServiceConfig):
    """FastAPI app of the attribution service (imported lazily: FastAPI is heavy)."""
    from trainguard.attribution._service import create_app as _create

    return _create(cfg)


__all__ = [
    "AgentDecision",
    "AnalysisResult",
    "AttributionClient",
    "AttributionError",
    "CATEGORIES",
    "Cascade",
    "Evidence",
    "FlightRecorderError",
    "FlightRecorderReport",
    "JOB_ENDED_DEFAULT",
    "JsonlPoster",
    "LogInputError",
    "RestartPolicy",
    "ResultStore",
    "ServiceConfig",
    "ServiceError",
    "SlackPoster",
    "WebhookPoster",
    "analyze",
    "analyze_flight_recorder",
    "analyze_logs",
    "create_app",
    "decide",
    "load_history",
    "load_registry",
]
