"""Attribution service over HTTP (FastAPI): submit, poll, list by job, health, metrics.

Routes (all ``/v1`` routes need ``X-API-Key`` or ``Authorization: Bearer``):

* ``POST /v1/analyses``            ``{job_id, cycle, log_paths, fr_dir?, job_ended?}`` -> 202
* ``GET  /v1/analyses/{id}``       status and, when completed, the result
* ``GET  /v1/jobs/{job_id}/analyses``  every analysis of a job, by cycle
* ``GET  /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``
* NVRx's launcher client: ``POST /logs``, ``GET /logs`` (and ``/k/<key>/logs``), see
  ``_nvrx_routes``

Errors are JSON ``{error_code, message}`` with a 4xx status.

Follows: NVRx ``nvrx-attrsvc`` (allowed root with realpath/commonpath checks, coalescing,
per-client limits) and adds authentication, body limits and SQLite persistence.
"""


from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from trainguard.attribution._nvrx_routes import add_nvrx_routes
from trainguard.attribution._pipeline import JOB_ENDED_DEFAULT
from trainguard.attribution._svc_core import AnalysisService, ServiceConfig
from trainguard.attribution._svc_security import (
    ApiError,
    BodyLimitMiddleware,
    RateLimiter,
    check_key,
    client_id,
)

__all__ = ["create_app"]

_ID = r"^[A-Za-z0-9._:-]{1,128}$"


class SubmitRequest(BaseModel):
    """An analysis request."""

    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(pattern=_ID, description="scheduler job id or any stable job name")
    cycle: StrictInt = Field(default=0, ge=0, le=1_000_000_000, description="restart cycle")
    log_paths: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list,
                                                                    max_length=1024)
    fr_dir: Annotated[str, Field(max_length=4096)] | None = None
    job_ended: StrictBool = JOB_ENDED_DEFAULT


class Analysis(BaseModel):
    id: str
    job_id: str
    cycle: int
    status: str = Field(description="pending, running, completed or failed")
    decision: str | None = None
    reason: str | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    coalesced: bool = False


class JobAnalyses(BaseModel):
    job_id: str
    analyses: list[Analysis]


class ErrorBody(BaseModel):
    error_code: str
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 413, 422, 429)}


def _view(rec: dict[str, Any], coalesced: bool = False) -> Analysis:
    res = rec.get("result") or {}
    return Analysis(id=rec["id"], job_id=rec["job_id"], cycle=rec["cycle"], status=rec["status"],
                    decision=res.get("decision"), reason=res.get("reason"),
                    result=res or None, error=rec.get("error"), coalesced=coalesced)


def _error(status: int, code: str, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"error_code": code, "message": message}, status, headers=headers)


def create_app(cfg: ServiceConfig) -> FastAPI:
    """Build the FastAPI application for ``cfg`` (the service starts with the app's lifespan)."""
    keys = [k.encode() for k in cfg.api_keys]
    limiter = RateLimiter(cfg.rate_per_minute)
    holder: dict[str, AnalysisService] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        holder["svc"] = AnalysisService(cfg)
        try:
            yield
        finally:
            holder.pop("svc").close()

    app = FastAPI(title="trainguard attribution service", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if holder.get("svc"):
            holder["svc"].metrics.inc("rejected_total", reason=exc.code)
        return _error(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(422, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}")

    def guard(request: Request, x_api_key: Annotated[str | None, Header()] = None,
              authorization: Annotated[str | None, Header()] = None) -> AnalysisService:
        presented = x_api_key
        if presented is None and authorization and authorization.lower().startswith("bearer "):
            presented = authorization[7:].strip()
        wait = limiter.take(client_id(presented, request.client.host if request.client else None))
        if wait > 0:
            raise ApiError(429, "rate_limited", "too many requests; slow down",
                           {"Retry-After": str(max(1, int(wait + 0.999)))})
        if keys and not check_key(presented, keys):
            raise ApiError(401, "unauthorized", "missing or invalid API key (X-API-Key header)")
        return holder["svc"]

    Svc = Annotated[AnalysisService, Depends(guard)]

    @app.post("/v1/analyses", status_code=202, response_model=Analysis, responses=_ERRORS)
    def submit(req: SubmitRequest, svc: Svc) -> Analysis:
        rec, coalesced = svc.submit(req.job_id, req.cycle, req.log_paths, req.fr_dir,
                                    req.job_ended)
        return _view(rec, coalesced)

    @app.get("/v1/analyses/{analysis_id}", response_model=Analysis, responses=_ERRORS)
    def get(analysis_id: str, svc: Svc) -> Analysis:
        rec = svc.store.get(analysis_id)
        if rec is None:
            raise ApiError(404, "not_found", f"no analysis {analysis_id!r}")
        return _view(rec)

    @app.get("/v1/jobs/{job_id}/analyses", response_model=JobAnalyses, responses=_ERRORS)
    def by_job(job_id: str, svc: Svc) -> JobAnalyses:
        return JobAnalyses(job_id=job_id, analyses=[_view(r) for r in svc.store.by_job(job_id)])

    add_nvrx_routes(app, lambda: holder["svc"], keys, limiter, cfg.nvrx_trust_loopback)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok" if holder.get("svc") else "starting"}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        svc = holder.get("svc")
        return svc.metrics.render(svc.gauges()) if svc else ""

    return app
