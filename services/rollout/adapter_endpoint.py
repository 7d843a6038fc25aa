"""The front door of the hot-swapped model (services/rollout/hot_swap.py) for the rollout services.

AdapterEndpoint  hot reload shared by `PUT /v1/adapter` on the ops app and the LoadAdapter RPCs: the bearer
                 token (env SOLRL_ADAPTER_TOKEN, hmac.compare_digest) and the size limit, then
                 HotSwapModel.load (sha256, version order); refusals answer with their REJECTIONS entry.
AdapterFetcher   pulls the run's current adapter from the trainer (GET /v1/adapter/current), at start-up and
                 when a call needs a newer version than was pushed here.
The headers an adapter travels with (services/common/adapter_headers.py) are parsed here.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Gauge
from starlette.concurrency import run_in_threadpool

from services.common.adapter_headers import SHA256_HEADER, VERSION_HEADER
from services.common.args import DEFAULT_MAX_ADAPTER_BYTES
from services.common.auth import refusal
from services.common.bodies import read_body
from services.common.budget import retry_headers
from services.common.env import ENV_ADAPTER_TOKEN
from services.common.errors import BodyTimeoutError, OverloadedError, TooLargeError
from services.common.metrics import ServiceMetrics
from services.rollout.hot_swap import REJECTIONS, AdapterRejected, HotSwapModel, LoadResult

log = logging.getLogger(__name__)


class AdapterFetcher:
    """Pulls the run's current adapter from the trainer's GET /v1/adapter/current and loads it through
    `HotSwapModel.load` (the same checks as a push). Used at start-up, so a rollout service that starts
    or restarts mid-run serves the current adapter before it takes jobs, and when a call needs a newer
    version than was pushed here. Failures are logged, never raised: pushes still work without it."""

    def __init__(self, trainer_url: str, token: str | None, model: HotSwapModel, timeout_s: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(trainer_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--trainer-url must be http(s)://host:port, got {trainer_url!r}")
        self.url = trainer_url.rstrip("/") + "/v1/adapter/current"
        self.token, self.model, self.timeout_s = token, model, float(timeout_s)
        self._lock = threading.Lock()

    def fetch(self) -> int | None:
        """Load the trainer's current adapter if it is newer; the version served afterwards, or None when
        the trainer could not be asked or has pushed nothing yet."""
        with self._lock:   # concurrent calls needing a newer version share one fetch
            request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token or ''}"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    if response.status == 204:
                        return None
                    data = response.read(self.model.max_bytes + 1)
                    version = int(response.headers.get(VERSION_HEADER, "0"))
                    sha256 = response.headers.get(SHA256_HEADER, "")
            except (OSError, ValueError) as exc:   # URLError and HTTPError are OSErrors
                log.warning("could not fetch the current adapter from %s: %s", self.url, exc)
                return None
            if version <= self.model.current().version:
                return self.model.current().version
            try:
                result = self.model.load(data, version=version, sha256=sha256)
            except AdapterRejected as exc:
                log.warning("adapter version %d fetched from %s refused (%s): %s", version, self.url, exc.reason, exc)
                return None
            log.info("fetched adapter version %d from %s", result.version, self.url)
            return result.version


class AdapterEndpoint:
    """Hot reload over HTTP (`mount`) and gRPC (`grpc_load`), with one auth and error policy.

    token=None (or "") disables loading: every push is refused with 403 / PERMISSION_DENIED.
    """

    def __init__(self, model: HotSwapModel, *, token: str | None, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
                 metrics: ServiceMetrics | None = None) -> None:
        if not isinstance(model, HotSwapModel):
            raise TypeError(f"model must be a HotSwapModel, got {type(model).__name__}")
        if token is not None and not isinstance(token, str):
            raise TypeError("token must be a str or None")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a positive int (0: derived from the model), got {max_bytes!r}")
        if max_bytes:   # the flag's limit, for the fetcher too
            model.max_bytes = max_bytes
        self.model, self.max_bytes = model, model.max_bytes
        self._token = token.encode() if token else None
        self._loads: Counter | None = None
        if metrics is not None:
            Gauge("solrl_adapter_version", "Adapter version being served", ["service"],
                  registry=metrics.registry).labels(metrics.service).set_function(lambda: model.current().version)
            self._loads = Counter("solrl_adapter_loads", "Adapter pushes, by outcome", ["service", "outcome"],
                                  registry=metrics.registry)
            self._service = metrics.service

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def status(self) -> dict[str, Any]:
        cur = self.model.current()
        return {"version": cur.version, "sha256": cur.sha256}

    def authorize(self, authorization: str | None) -> None:
        """Refuse unless the Authorization value carries the token (services.common.auth.refusal)."""
        if self._token is None:
            raise AdapterRejected("disabled", f"adapter loading is disabled: the server has no token "
                                              f"(set {ENV_ADAPTER_TOKEN} where it starts)")
        why = refusal(authorization, self._token)
        if why is not None:
            raise AdapterRejected("unauthenticated", why)

    def _count(self, outcome: str) -> None:
        if self._loads is not None:
            self._loads.labels(self._service, outcome).inc()

    def load(self, authorization: str | None, data: bytes, version: int, sha256: str) -> LoadResult:
        """Authorize (the raw Authorization value) then HotSwapModel.load; outcomes are counted."""
        try:
            self.authorize(authorization)
            result = self.model.load(data, version=version, sha256=sha256, max_bytes=self.max_bytes)
        except AdapterRejected as exc:
            self._count(exc.reason)
            log.info("adapter push refused (%s): %s", exc.reason, exc)
            raise
        self._count("ok")
        return result

    def grpc_load(self, context: grpc.ServicerContext, data: bytes, version: int, sha256: str) -> LoadResult:
        """For a LoadAdapter RPC: token from the 'authorization' metadata; refusals abort with their code."""
        metadata: Sequence[tuple[str, Any]] = context.invocation_metadata() or ()
        authorization = next((v for k, v in metadata if k.lower() == "authorization"), None)
        try:
            return self.load(authorization if isinstance(authorization, str) else None, data, version, sha256)
        except AdapterRejected as exc:
            context.abort(exc.grpc_code, str(exc))  # raises
            raise

    def mount(self, app: FastAPI) -> None:
        """PUT /v1/adapter (safetensors body) and GET /v1/adapter on `app`."""

        @app.exception_handler(AdapterRejected)
        async def rejected(request: Request, exc: AdapterRejected) -> JSONResponse:
            headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else \
                retry_headers() if exc.reason == "busy" else None
            return JSONResponse({"error": exc.reason, "detail": str(exc), **self.status()},
                                status_code=exc.http_status, headers=headers)

        @app.get("/v1/adapter")
        def adapter_status() -> dict[str, Any]:
            return self.status()

        @app.put("/v1/adapter", openapi_extra=_PUT_ADAPTER_OPENAPI,
                 responses={REJECTIONS[r][0]: {"description": r} for r in REJECTIONS})
        async def put_adapter(request: Request) -> dict[str, Any]:
            authorization = request.headers.get("authorization")
            try:
                self.authorize(authorization)  # before reading a byte of the body
                data = await self._read_body(request)
                version = _header_int(request.headers.get(VERSION_HEADER), VERSION_HEADER)
                sha256 = request.headers.get(SHA256_HEADER)
                if not sha256:
                    raise AdapterRejected("invalid", f"{SHA256_HEADER} header is required")
            except AdapterRejected as exc:
                self._count(exc.reason)
                raise
            result = await run_in_threadpool(self.load, authorization, data, version, sha256)
            return {"version": result.version, "sha256": result.sha256, "swap_ms": round(result.swap_ms, 3),
                    "previous_version": result.previous_version}

    async def _read_body(self, request: Request) -> bytes:
        try:
            return await read_body(request, self.max_bytes, what="adapter body")
        except TooLargeError as exc:
            raise AdapterRejected("too_large", str(exc)) from None
        except BodyTimeoutError as exc:
            raise AdapterRejected("invalid", str(exc)) from None
        except OverloadedError as exc:
            raise AdapterRejected("busy", str(exc)) from None


# The PUT route reads its headers and raw body itself (to refuse before reading the body); this
# describes them in the ops app's OpenAPI document, which clients and the fuzz tests read.
_PUT_ADAPTER_OPENAPI: dict[str, Any] = {
    "parameters": [
        {"name": "Authorization", "in": "header", "required": True, "schema": {"type": "string"},
         "description": f"Bearer <token> ({ENV_ADAPTER_TOKEN})"},
        {"name": VERSION_HEADER, "in": "header", "required": True, "schema": {"type": "integer", "minimum": 1}},
        {"name": SHA256_HEADER, "in": "header", "required": True,
         "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
    ],
    "requestBody": {"required": True, "description": "the adapter as safetensors bytes (never pickle)",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
}


def _header_int(value: str | None, name: str) -> int:
    if value is None or not value.strip():
        raise AdapterRejected("invalid", f"{name} header is required")
    try:
        return int(value.strip())
    except ValueError:
        raise AdapterRejected("invalid", f"{name} header must be an integer, got {value!r}") from None
