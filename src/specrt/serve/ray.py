"""`specrt serve` on Ray Serve: engine replicas behind the same OpenAI app (the `ray` extra).

Two deployments make the application:

- `SpecrtEngine`: each replica loads the bundle (hash-checked, as `specrt serve` does) into a
  `LocalService`, whose worker runs the batched scheduler, and streams a request's events back
  through its deployment handle. `max_ongoing_requests` is two batches (the running one and
  the next, so a freed slot fills without a round trip to the router); requests beyond that
  wait in Ray's router, where whichever replica frees up first takes them, and past
  `--max-queue` of them the router refuses (429). Ray's health check fails when the engines do,
  and a replica that is scaled down or redeployed finishes its requests first
  (`graceful_shutdown_timeout_s`).
- `SpecrtIngress`: the app of `specrt serve`, built by `create_app` over a `RayService`, which
  forwards each request to an engine replica: the same routes, auth, errors, validation and
  SSE, no second copy.

`app` is the application builder (`serve run specrt.serve.ray:app bundle=PATH replicas=2`, or a
Serve config, see configs/ray-serve.yaml), `run` the one-line local start behind
`specrt serve --ray`. Metrics are Ray's (`ray.serve.metrics`): every replica exports them
through its node's metrics agent, labelled by deployment and replica, so one Prometheus scrape
per node sees them all. Nothing else in specrt imports this module, or Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import ray
from pydantic import TypeAdapter
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve import metrics as ray_metrics
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from specrt.errors import SpecrtError
from specrt.serve.app import create_app
from specrt.serve.errors import APIError
from specrt.serve.events import Event, Failed, is_last
from specrt.serve.metrics import Instrument, Metrics
from specrt.serve.render import Shape
from specrt.serve.request_ids import REQUEST_ID
from specrt.serve.server import LAST_WORDS
from specrt.serve.service import Body, LocalService
from specrt.serve.settings import RayOptions, ServeSettings

log = logging.getLogger("specrt.serve")

APP_NAME = "specrt"
REPLICA_HEADER = "x-specrt-replica"
ONGOING_BATCHES = 2  # a replica holds the batch it runs and the next one; the rest wait in Ray
HEALTH_TIMEOUT_S = 10.0


def engine_options(settings: ServeSettings, options: RayOptions) -> dict:
    """The engine deployment's Serve options, from the server's settings."""
    scaling: dict = {"num_replicas": options.replicas}
    if options.autoscaling:
        low, high = options.bounds
        scaling = {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": max(low, 1),
                "max_replicas": high,
                "target_ongoing_requests": options.target_ongoing_requests or settings.max_batch,
            }
        }
    return {
        **scaling,
        "max_ongoing_requests": ONGOING_BATCHES * settings.max_batch,
        "max_queued_requests": settings.max_queue,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": options.health_check_period_s,
        "ray_actor_options": {"num_cpus": options.cpus_per_replica or settings.threads or 1},
    }


class RayMetric:
    """One of Ray's metrics, called the way prometheus_client's are (see `Instrument`)."""

    def __init__(self, metric, keys: tuple[str, ...] = (), tags: dict[str, str] | None = None):
        self.metric, self.keys, self.tags = metric, keys, tags

    def labels(self, *values: str) -> Instrument:
        return RayMetric(self.metric, self.keys, dict(zip(self.keys, values, strict=True)))

    def inc(self, amount: float = 1) -> None:
        if amount:  # Ray refuses a zero increment; it would change nothing
            self.metric.inc(amount, tags=self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value, tags=self.tags)


class RayInstruments:
    """Ray Serve's metrics: deployment, replica and application tags come with them."""

    prefix = "specrt_"  # Ray refuses ':' in names, and exports them as ray_specrt_*
    where = (
        "under Ray Serve, every replica's metrics are exported by its node's Ray metrics "
        "agent (the port of `ray start --metrics-export-port`) as ray_specrt_*, labelled by "
        "deployment and replica"
    )

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Instrument:
        return RayMetric(ray_metrics.Counter(self.prefix + name, doc, tag_keys=labels), labels)

    def gauge(self, name: str, doc: str) -> Instrument:
        return RayMetric(ray_metrics.Gauge(self.prefix + name, doc))

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Instrument:
        return RayMetric(ray_metrics.Histogram(self.prefix + name, doc, list(buckets)))

    def exposition(self) -> None:
        return None


class EngineReplica:
    """One replica: the bundle's engines and the worker that batches their requests."""

    def __init__(self, settings: ServeSettings):
        self.replica = serve.get_replica_context().replica_id.unique_id
        # Ray's router holds the queue: a replica is never sent more than two batches
        # (max_ongoing_requests), and its own queue must hold them all, since Ray may count
        # a finished request's slot free before the worker has admitted the next.
        local = replace(settings, max_queue=ONGOING_BATCHES * settings.max_batch)
        self.service = LocalService(local, metrics=Metrics(instruments=RayInstruments()))
        self.service.load()  # Ray routes to a replica once its constructor returns
        if self.service.load_error:
            raise SpecrtError(f"{settings.bundle} could not be loaded: {self.service.load_error}")

    async def events(
        self, body: Body, request_id: str | None = None
    ) -> AsyncIterator[tuple | Event]:
        """The replica's id and how the text is parsed (Job.shape), then the request's
        events. Cancelling the call (the client left) cancels the request. request_id: the
        ingress's, for this replica's log lines."""
        REQUEST_ID.set(request_id)
        try:
            (stream,) = await self.service.open(body)  # the ingress sends a choice a call
        except APIError as err:
            yield self.replica, Shape()
            yield Failed(err)
            return
        yield self.replica, stream.shape
        try:
            while True:
                event = await stream.next()
                yield event
                if is_last(event):
                    return
        finally:
            stream.cancel()

    async def health(self) -> tuple[str, dict]:
        status, detail = self.service.status()
        return status, {**detail, "replica": self.replica}

    async def model_card(self) -> dict:
        return await self.service.model_card()

    def check_health(self) -> None:
        """Ray's health check: a replica whose engines failed is replaced."""
        status, detail = self.service.status()
        if status != "ok":
            raise RuntimeError(detail["detail"])

    async def __del__(self) -> None:
        """Ray's shutdown hook, called once the replica's requests are done (graceful
        shutdown). What still runs then ends as under `specrt serve` (server.py): a stream
        with a last chunk, finish_reason "shutdown", and an error event; then the engines
        stop. (Requests that outlast Ray's graceful_shutdown_timeout_s never get here: Ray
        kills the replica, and the ingress ends their streams with a 503 error event.)"""
        if not hasattr(self, "service"):  # the constructor failed
            return
        self.service.drain()
        self.service.end()
        deadline = time.monotonic() + LAST_WORDS
        while not self.service.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the generators hand their last events on
        self.service.stop()


class RayStream:
    """A request's events from an engine replica; a replica that dies mid-request ends it
    with an explicit 503, never a hang."""

    def __init__(self, events: DeploymentResponseGenerator, replica: str, shape: Shape):
        self.events, self.headers = events, {REPLICA_HEADER: replica}
        self.shape = shape
        self._ended = False

    async def next(self) -> Event:
        try:
            event = await self.events.__anext__()
        except Exception as err:
            event = Failed(failure(err))
        self._ended = is_last(event)
        return event

    def cancel(self) -> None:
        if not self._ended:
            self._ended = True
            self.events.cancel()


class RayService:
    """The ingress's service: every request goes to an engine replica."""

    def __init__(self, engine: DeploymentHandle):
        self.engine = engine
        self.metrics = Metrics(instruments=RayInstruments())
        self._card: dict | None = None

    def start(self) -> None:
        pass  # the replicas load themselves

    def stop(self) -> None:
        pass

    async def health(self) -> tuple[str, dict]:
        """One engine replica's health; an error when none answers in time (with no replica
        running, Ray would hold the call until one starts)."""
        try:
            return await asyncio.wait_for(self.engine.health.remote(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "error", {"detail": f"no engine replica answered in {HEALTH_TIMEOUT_S:g}s"}
        except Exception as err:
            return "error", {"detail": f"no engine replica answered: {failure(err).message}"}

    async def model_card(self) -> dict:
        if self._card is None:
            self._card = await self.engine.model_card.remote()
        return self._card

    async def open(self, body: Body) -> list[RayStream]:
        """Each choice to a replica of its own choosing (n = 1 each); if one cannot be queued,
        none stays."""
        streams: list[RayStream] = []
        try:
            for choice in body.choices():
                streams.append(await self._open(choice))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    async def _open(self, body: Body) -> RayStream:
        events = self.engine.options(stream=True).events.remote(body, REQUEST_ID.get())
        try:
            replica, shape = await events.__anext__()
        except Exception as err:
            error = failure(err)
            if error.kind == "busy":
                self.metrics.rejected.inc()
            raise error from err
        return RayStream(events, replica, shape)


def failure(err: Exception) -> APIError:
    """What a client is told when the call to a replica fails."""
    if isinstance(err, BackPressureError):
        message = "the server is busy: every replica is full and the queue too; retry later"
        return APIError("busy", message, code="queue_full", headers={"Retry-After": "1"})
    if isinstance(err, RayTaskError | StopAsyncIteration):
        log.error("an engine replica failed: %s", err)
        return APIError("engine", f"the engines failed: {type(err).__name__}", code="engine")
    if isinstance(err, RayError | DeploymentUnavailableError):
        message = (
            f"the engine replica serving this request is gone ({type(err).__name__}); "
            "Ray is replacing it: retry"
        )
        return APIError("unavailable", message, code="replica_unavailable")
    log.exception("the call to an engine replica failed", exc_info=err)
    return APIError("engine", f"the engines failed: {type(err).__name__}: {err}", code="engine")


@serve.ingress()
class Ingress:
    """The OpenAI app of `specrt serve`, over the engine replicas."""

    def __init__(self, engine: DeploymentHandle, settings: ServeSettings):
        self._app = create_app(settings, service=RayService(engine))

    def __serve_build_asgi_app__(self):
        return self._app


def build(settings: ServeSettings, options: RayOptions) -> serve.Application:
    engine = serve.deployment(
        EngineReplica, name="SpecrtEngine", **engine_options(settings, options)
    )
    ingress = serve.deployment(
        Ingress,
        name="SpecrtIngress",
        num_replicas=options.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,  # it only forwards; the engines' limits bound the load
    )
    return ingress.bind(engine.bind(settings), settings)


def app(args: dict) -> serve.Application:
    """The application builder: `serve run specrt.serve.ray:app bundle=PATH [name=value ...]`,
    or `args` in a Serve config. Names are ServeSettings' and RayOptions' fields."""
    settings_names = {f.name for f in dataclasses.fields(ServeSettings)}
    options_names = {f.name for f in dataclasses.fields(RayOptions)}
    unknown = set(args) - settings_names - options_names
    if unknown:
        known = ", ".join(sorted(settings_names | options_names))
        raise SpecrtError(f"unknown argument(s) {', '.join(sorted(unknown))}; known: {known}")
    if "bundle" not in args:
        raise SpecrtError("the argument bundle=PATH is required")
    settings = TypeAdapter(ServeSettings).validate_python(
        {k: v for k, v in args.items() if k in settings_names}
    )
    options = TypeAdapter(RayOptions).validate_python(
        {k: v for k, v in args.items() if k in options_names}
    )
    settings.check()
    options.check()
    return build(settings, options)


def run(
    settings: ServeSettings,
    options: RayOptions,
    address: str | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """Deploy on Ray and serve until interrupted. Without an address, a local cluster starts
    in this process on the loopback address; with one (`auto`, `ray://...`), the application
    joins that cluster, whose every node must see the bundle's path. SIGTERM (a container
    stopping) ends it as Ctrl-C does: the application is deleted, each replica first
    finishing its requests."""
    if address is None:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    else:
        ray.init(address=address)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # after Ray's own, which aborts
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build(settings, options), name=APP_NAME, route_prefix="/")
        say(f"serving {settings.served_model} on http://{settings.host}:{settings.port}/v1")
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        serve.delete(APP_NAME)  # each replica finishes its requests (graceful shutdown)
        if address is None:
            serve.shutdown()
            ray.shutdown()
