"""The HTTP face of a simulated SGLang 0.5.23 replica (a plain Starlette app).

One app owns one :class:`~loadtest.simulator.engine.ReplicaEngine`, driven in real time
by a :class:`~loadtest.simulator.clock.RealtimeDriver` (``time_scale`` simulated seconds
per wall second). Generation routes turn a request body into a ``SimRequest``, submit it,
and relay what the engine emits: every engine callback lands in a per-request
``asyncio.Queue``; streaming responses turn each batch of tokens into one SSE event;
non-streaming ones wait for ``on_finish``. A client that leaves aborts its request.

The hot path is lean on purpose (a replica must take ~200 req/s of 400 KB prompts):
orjson in and out, no pydantic, no FastAPI dependency machinery. Wire shapes live in
:mod:`.protocol`, request parsing in :mod:`.intake`, introspection bodies in :mod:`.info`,
the generation routes in :mod:`.generation`, metrics in :mod:`.metrics`, fault injection
in :mod:`.faults`. Admin routes beyond SGLang's: ``GET|POST /_sim/faults``.

Lifecycle (contract §5): :meth:`Replica.begin_drain` (SIGTERM) makes ``/health``,
``/health_generate`` and ``/ready`` answer 503 at once, keeps serving every request
(new ones too), and calls ``on_drained`` once nothing is in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.simulator import info, protocol
from loadtest.simulator.clock import RealtimeDriver
from loadtest.simulator.config import SimServerConfig
from loadtest.simulator.engine import ReplicaEngine
from loadtest.simulator.faults import FaultConfig, FaultConfigError, Faults
from loadtest.simulator.generation import generation_routes
from loadtest.simulator.metrics import CONTENT_TYPE, SimMetrics

log = logging.getLogger("kvgate.sim")

DRAIN_POLL_S = 0.1
DRAIN_LOG_EVERY_S = 5.0
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")


class Replica:
    """Everything one replica process holds: engine, driver, flags, in-flight requests."""

    def __init__(self, config: SimServerConfig, on_drained: Callable[[], None] | None = None) -> None:
        self.config = config
        self.profile = config.profile
        self.engine = ReplicaEngine(config.profile, seed=config.seed)
        self.driver = RealtimeDriver(self.engine, config.time_scale)
        self.metrics = SimMetrics(config.profile.served_model_name,
                                  hicache=config.profile.host_tokens > 0,
                                  spec=config.profile.spec_algorithm is not None)
        self.faults = Faults(config.faults, config.seed)
        self.model_dir = config.model_dir or info.model_dir(config.profile)
        self.server_args = info.server_args(config, self.model_dir)
        self.on_drained = on_drained
        self.in_flight: dict[str, Callable[[], None]] = {}  # rid -> abort
        self.draining = False
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.started_wall_s = time.time()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        info.write_model_dir(self.model_dir, self.profile)
        self._tasks.append(asyncio.create_task(self.driver.run(), name="sim-driver"))
        if self.config.handle_sigterm:  # replaces uvicorn's handler, as SGLang does
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.begin_drain)
        try:
            yield
        finally:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def begin_drain(self) -> None:
        """SIGTERM: fail health and readiness now, exit once nothing is in flight."""
        if self.draining:
            return
        self.draining = True
        log.warning("SIGTERM received. Draining requests and shutting down...")
        self._tasks.append(asyncio.create_task(self._drain_watch(), name="sim-drain"))

    async def _drain_watch(self) -> None:
        last_log = 0.0
        while self.in_flight:
            now = time.monotonic()
            if now - last_log >= DRAIN_LOG_EVERY_S:
                log.warning("Gracefully exiting... Remaining number of requests %d", len(self.in_flight))
                last_log = now
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("Gracefully exiting... Remaining number of requests 0")
        if self.on_drained is not None:
            self.on_drained()

    # ---- admin routes -----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.draining else 200)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=503 if (self.draining or self.paused) else 200)

    async def pause_generation(self, request: Request) -> Response:
        body = await _json_or_empty(request)
        self.paused = True
        self.resumed.clear()
        if body.get("mode") == "abort":
            for abort in list(self.in_flight.values()):
                abort()
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.paused = False
        self.resumed.set()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: Request) -> Response:
        if self.engine.flush_cache():
            return Response(FLUSH_OK)  # SGLang sets no content-type here
        return Response("Flush cache failed.\n", status_code=400, media_type="text/plain")

    async def metrics_route(self, request: Request) -> Response:
        self.metrics.set_scheduler(info.scheduler_sample(self.driver.snapshot(), self.profile))
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def server_info(self, request: Request) -> Response:
        return _json(info.server_info(self.server_args, self.driver.snapshot(), self.profile,
                                      self.started_wall_s))

    async def model_info(self, request: Request) -> Response:
        return _json(info.model_info(self.profile, self.model_dir))

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [info.model_card(self.profile, self.started_wall_s)]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.profile.served_model_name:
            return _json(protocol.model_not_found(name), 404)
        return _json(info.model_card(self.profile, self.started_wall_s))

    async def loads(self, request: Request) -> Response:
        q = request.query_params
        body = info.loads(self.driver.snapshot(), self.profile, q.get("include", "all"))
        if q.get("dp_rank") not in (None, "0"):
            body["loads"] = []
        if q.get("format") == "prometheus":
            return Response(info.loads_prometheus(body), media_type=CONTENT_TYPE)
        return _json(body)

    async def get_faults(self, request: Request) -> Response:
        return _json(self.faults.config.to_json())

    async def set_faults(self, request: Request) -> Response:
        try:
            self.faults.config = FaultConfig.from_json(orjson.loads(await request.body()))
        except (orjson.JSONDecodeError, FaultConfigError) as e:
            return _json(protocol.error_response(str(e)), 400)
        return _json(self.faults.config.to_json())

    def routes(self) -> list[Route]:
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/pause_generation", self.pause_generation, methods=["POST"]),
            Route("/continue_generation", self.continue_generation, methods=["POST"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/_sim/faults", self.get_faults, methods=["GET"]),
            Route("/_sim/faults", self.set_faults, methods=["POST"]),
            *generation_routes(self),
        ]


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def _json_or_empty(request: Request) -> dict[str, object]:
    raw = await request.body()
    try:
        obj = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's shape for routing errors: ``{"detail": "Not Found"}`` and friends."""
    assert isinstance(exc, HTTPException)
    return _json({"detail": exc.detail}, exc.status_code)


def build_app(config: SimServerConfig, on_drained: Callable[[], None] | None = None) -> Starlette:
    """A Starlette app for one simulated replica; ``app.state.replica`` is its state."""
    replica = Replica(config, on_drained)
    app = Starlette(routes=replica.routes(), lifespan=replica.lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.replica = replica
    return app
