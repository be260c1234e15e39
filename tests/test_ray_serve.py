"""`specrt serve` on Ray Serve: a real local Ray cluster on the loopback address, two engine
replicas of a tiny bundle, driven by the official `openai` client. Every load is bounded in
count and time (each request has a client timeout, and nothing retries)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import openai
import pytest
from servers import client, free_port, http, metric_values, serving, wait_healthy

from specrt.exporter.build import build_bundle
from specrt.runtime import SpeculativeRuntime
from specrt.serve import ServeSettings
from specrt.serve.settings import RayOptions

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
from ray import serve  # noqa: E402

from specrt.serve.ray import APP_NAME, REPLICA_HEADER, app, build  # noqa: E402

KEY = "ray-key"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n", "class Stack:"]
GREEDY = {"temperature": 0}
TOKENS = 400  # per request under load: long enough to be in flight when a replica goes
TWO = RayOptions(replicas=2, cpus_per_replica=0.5, graceful_shutdown_s=60)


@pytest.fixture(scope="module")
def bundle(pairs, tmp_path_factory) -> Path:
    draft, target = pairs["llama"]
    out = tmp_path_factory.mktemp("ray") / "tiny"
    return build_bundle(str(draft), str(target), out, max_context=512, log=lambda _: None)


@pytest.fixture(scope="module")
def reference(bundle) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundle, calibrate=False)


def settings_for(bundle: Path, **changes) -> ServeSettings:
    return ServeSettings(
        bundle=bundle, model_name="tiny", api_key=KEY, calibrate=False, max_batch=4, **changes
    )


@dataclass
class Cluster:
    base: str  # Serve's HTTP proxy
    metrics: str  # the node's metrics agent


@pytest.fixture(scope="module")
def cluster(bundle):
    """A local cluster with the application deployed at 2 engine replicas."""
    metrics_port, http_port = free_port(), free_port()
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        deploy(bundle, TWO)
        yield Cluster(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(bundle: Path, options: RayOptions) -> None:
    serve.run(build(settings_for(bundle), options), name=APP_NAME, route_prefix="/")


def engine_replicas() -> dict[str, int]:
    status = serve.status().applications[APP_NAME].deployments["SpecrtEngine"]
    return dict(status.replica_states)


def wait_for_replicas(count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while engine_replicas() != {"RUNNING": count}:
        assert time.monotonic() < deadline, f"not {count} running replicas: {engine_replicas()}"
        time.sleep(0.5)


def complete(api: openai.OpenAI, prompt: str, tokens: int, eos: bool = False) -> tuple[str, str]:
    """(text, replica) of a greedy completion (of exactly `tokens` unless `eos`)."""
    raw = api.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=tokens, extra_body={"ignore_eos": not eos}, **GREEDY
    )
    return raw.parse().choices[0].text, raw.headers[REPLICA_HEADER]


def test_the_cli_deploys_on_ray_and_stops_on_sigterm(bundle, reference, tmp_path):
    """`specrt serve --ray` starts its own local cluster (before the module's, so the two never
    share the machine), serves, and deletes the application when told to stop."""
    port = free_port()
    command = [sys.executable, "-m", "specrt.cli", "serve", str(bundle), "--ray"]
    command += ["--port", str(port), "--model-name", "tiny", "--max-batch", "2"]
    log = tmp_path / "serve.log"  # a file, not a pipe: Ray writes more than a pipe holds
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stderr=sink, stdout=sink, text=True, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if http(f"{base}/health")[0] == 200:
                    break
            except (OSError, ValueError):  # not listening yet; Serve's own 404 before the app
                pass
            assert time.monotonic() < deadline, "specrt serve --ray did not become healthy"
            time.sleep(0.5)
        want = reference.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True).text
        assert complete(client(base, timeout=60), PROMPTS[0], 12)[0] == want
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == 0, log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def test_completions_and_chat_equal_specrt_generate(cluster, reference, bundle):
    from click.testing import CliRunner

    from specrt.cli import cli

    api = client(cluster.base, KEY, timeout=60)
    replicas = set()
    for prompt in PROMPTS:
        want = reference.generate(prompt, max_new_tokens=24, ignore_eos=True).text
        text, replica = complete(api, prompt, 24)
        replicas.add(replica)
        assert text == want
        streamed = api.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=24,
            stream=True,
            **GREEDY,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in streamed) == want

    messages = [{"role": "user", "content": "Write a haiku about caches."}]
    want = reference.generate(messages, max_new_tokens=20, temperature=0).text
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=20, **GREEDY)
    assert chat.choices[0].message.content == want
    chunks = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        stream=True,
        **GREEDY,
        stream_options={"include_usage": True},
    )
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    several = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, n=2, **GREEDY
    )  # a generation each, wherever the router sends them
    assert [choice.message.content for choice in several.choices] == [want, want]

    generated = CliRunner().invoke(
        cli, ["generate", str(bundle), PROMPTS[1], "--max-new-tokens", "24", "--json"]
    )
    assert generated.exit_code == 0, generated.output
    assert complete(api, PROMPTS[1], 24, eos=True)[0] == json.loads(generated.output)["text"]

    with ThreadPoolExecutor(8) as pool:  # concurrent: the router spreads them
        replicas |= {r for _, r in pool.map(lambda i: complete(api, PROMPTS[i % 4], 8), range(16))}
    assert len(replicas) == 2, f"one replica served everything: {replicas}"


BAD = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 3}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 0}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}'),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user"'),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
        b' "prediction": {"type": "content", "content": 3}}',
    ),
]


def test_bad_requests_get_the_same_4xx_as_specrt_serve(cluster, bundle):
    """Validation, refusals and the runtime's value checks (in a replica) give the very bodies
    `specrt serve` gives; a missing key gets the same 401."""
    long_prompt = "word " * 600
    cases = [*BAD, ("/v1/completions", f'{{"prompt": "{long_prompt}"}}'.encode())]
    auth = {"Authorization": f"Bearer {KEY}"}
    with serving(settings_for(bundle)) as (local, _):
        assert wait_healthy(local)["status"] == "ok"
        for path, body in cases:
            want = http(f"{local}{path}", body, auth)
            got = http(f"{cluster.base}{path}", body, auth)
            assert 400 <= want[0] < 500 and got == want, (path, body)
        want = http(f"{local}/v1/models")
        assert want[0] == 401 and http(f"{cluster.base}/v1/models") == want


def test_health_and_model_card_come_from_the_replicas(cluster):
    status, body = http(f"{cluster.base}/health")
    assert status == 200 and body["status"] == "ok" and body["replica"]
    card = client(cluster.base, KEY).models.retrieve("tiny")
    assert card.max_model_len == 512 and card.owned_by == "specrt"
    status, body = http(f"{cluster.base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 404 and "ray_specrt_" in body["error"]["message"]


def test_metrics_are_exported_from_every_replica(cluster):
    """One scrape of the node's metrics agent: request counts labelled by replica, for both."""
    api = client(cluster.base, KEY, timeout=60)
    with ThreadPoolExecutor(8) as pool:
        served = {r for _, r in pool.map(lambda i: complete(api, PROMPTS[i % 4], 6), range(16))}
    deadline = time.monotonic() + 60
    while not served <= set(per := counted(cluster, "ray_specrt_requests_total")):
        assert time.monotonic() < deadline, f"served by {served}, counted for {per}"
        time.sleep(1)
    assert all(value > 0 for value in per.values())
    tokens = counted(cluster, "ray_specrt_generation_tokens_total")
    assert served <= set(tokens) and all(value > 0 for value in tokens.values())


def counted(cluster: Cluster, name: str, **labels) -> dict[str, float]:
    """A metric from the node's metrics agent, summed per engine replica."""
    per_replica: dict[str, float] = {}
    for (metric, pairs), value in metric_values(cluster.metrics).items():
        pairs = dict(pairs)
        if metric != name or pairs.get("deployment") != "SpecrtEngine":
            continue
        if all(pairs.get(k) == v for k, v in labels.items()):
            per_replica[pairs["replica"]] = per_replica.get(pairs["replica"], 0) + value
    return per_replica


def test_a_client_that_leaves_mid_stream_cancels_its_request(cluster):
    """The client closes a long stream after a few chunks: the replica that ran it records it
    as cancelled (the proxy, the ingress and the replica each pass the cancellation on)."""
    api = client(cluster.base, KEY, timeout=60)
    before = counted(cluster, "ray_specrt_requests_total", outcome="cancelled")
    raw = api.completions.with_raw_response.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True, "speculation": "off"},
        **GREEDY,
    )
    replica, stream = raw.headers[REPLICA_HEADER], raw.parse()
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while counted(cluster, "ray_specrt_requests_total", outcome="cancelled").get(
        replica, 0
    ) <= before.get(replica, 0):
        assert time.monotonic() < deadline, "the replica never recorded the cancellation"
        time.sleep(0.5)


@dataclass
class Outcome:
    kind: str  # ok, wrong (the output differs), 5xx (an explicit error), hung, or a 4xx status
    replica: str | None
    started: float
    ended: float


def run_load(
    api: openai.OpenAI, want: dict[str, str], clients: int, each: int, during=None, **extra
):
    """clients x each greedy requests (every other one streamed), each client's in turn;
    `during()` runs once the first request has completed, and its start time is returned
    with every request's outcome. `extra` goes into every request's body."""
    first_done = []

    def one(i: int) -> Outcome:
        prompt, started, replica = list(want)[i % len(want)], time.monotonic(), None
        try:
            raw = api.completions.with_raw_response.create(
                model="tiny",
                prompt=prompt,
                max_tokens=TOKENS,
                stream=bool(i % 2),
                extra_body={"ignore_eos": True, **extra},
                **GREEDY,
            )
            replica, reply = raw.headers.get(REPLICA_HEADER), raw.parse()
            text = "".join(c.choices[0].text for c in reply) if i % 2 else reply.choices[0].text
            kind = "ok" if text == want[prompt] else "wrong"
        except openai.APITimeoutError:
            kind = "hung"
        except openai.APIStatusError as err:
            kind = "5xx" if err.status_code >= 500 else str(err.status_code)
        except openai.APIError:  # an error event in a stream that had begun
            kind = "5xx"
        first_done.append(i)
        return Outcome(kind, replica, started, time.monotonic())

    def client_loop(c: int) -> list[Outcome]:
        return [one(c * each + j) for j in range(each)]

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client_loop, c) for c in range(clients)]
        deadline = time.monotonic() + 120
        while during and not first_done and time.monotonic() < deadline:
            time.sleep(0.05)
        moment = time.monotonic()
        if during:
            during()
        return moment, [outcome for f in futures for outcome in f.result(timeout=300)]


def tally(outcomes: list[Outcome]) -> dict[str, int]:
    kinds = [o.kind for o in outcomes]
    return {kind: kinds.count(kind) for kind in set(kinds)}


@pytest.fixture(scope="module")
def long_outputs(reference) -> dict[str, str]:
    return {p: reference.generate(p, max_new_tokens=TOKENS, ignore_eos=True).text for p in PROMPTS}


def test_failover_when_a_replica_dies_under_load(cluster, long_outputs, bundle):
    """8 clients x 4 requests; one engine replica is killed after the first completes. Each
    request completes with the right output or gets an explicit 5xx: none hangs, none is
    dropped, and the replacement replica serves later requests beside the survivor."""
    api = client(cluster.base, KEY, timeout=90)
    victim = complete(api, PROMPTS[0], 4)[1]

    def kill() -> None:
        actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#SpecrtEngine#{victim}", namespace="serve")
        ray.kill(actor, no_restart=True)

    _, outcomes = run_load(api, long_outputs, clients=8, each=4, during=kill)
    counts = tally(outcomes)
    print(f"failover outcomes: {counts}")
    assert len(outcomes) == 32 and set(counts) <= {"ok", "5xx"}, counts
    assert counts.get("ok", 0) >= 16, counts

    wait_for_replicas(2)
    served = set()
    deadline = time.monotonic() + 120
    while len(served - {victim}) < 2 and time.monotonic() < deadline:
        with ThreadPoolExecutor(8) as pool:
            served |= {r for _, r in pool.map(lambda i: complete(api, PROMPTS[i % 4], 6), range(8))}
    assert victim not in served or len(served) >= 3
    assert len(served - {victim}) == 2, f"the new replica served nothing: {served}"


def test_scaling_down_under_load_loses_no_request(cluster, long_outputs, bundle):
    """2 -> 1 replica while 8 clients x 3 requests run: the replica that leaves finishes the
    requests it holds (graceful shutdown), so every one completes with the right output."""
    wait_for_replicas(2)
    api = client(cluster.base, KEY, timeout=120)
    one = RayOptions(replicas=1, cpus_per_replica=0.5, graceful_shutdown_s=60)
    scaled, outcomes = run_load(
        api, long_outputs, clients=8, each=3, during=lambda: deploy(bundle, one), speculation="off"
    )
    wait_for_replicas(1)
    survivor = complete(api, PROMPTS[0], 2)[1]
    assert [o.kind for o in outcomes] == ["ok"] * 24, tally(outcomes)
    drained = [o for o in outcomes if o.replica != survivor and o.started < scaled < o.ended]
    assert drained, "the leaving replica held no request when the scale-down began"
    deploy(bundle, TWO)


def test_autoscaling_adds_a_replica_under_load(cluster, long_outputs, bundle):
    """From 1 replica, bounds 1..2, a target of 1 ongoing request: 4 clients keep it busy until
    Ray starts the second replica (its upscale delay is 30 s), and every output is right."""
    scaling = RayOptions(min_replicas=1, max_replicas=2, target_ongoing_requests=1)
    deploy(bundle, replace(scaling, cpus_per_replica=0.5, graceful_shutdown_s=60))
    wait_for_replicas(1)
    api = client(cluster.base, KEY, timeout=120)
    stop = threading.Event()

    def keep_busy(c: int) -> list[bool]:
        right, i = [], c
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            right.append(complete(api, prompt, TOKENS)[0] == long_outputs[prompt])
            i += 1
        return right

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(keep_busy, c) for c in range(4)]
        try:
            deadline = time.monotonic() + 150
            while engine_replicas().get("RUNNING", 0) < 2 and time.monotonic() < deadline:
                time.sleep(1)
            scaled_up = engine_replicas().get("RUNNING", 0) == 2
        finally:
            stop.set()
        right = [ok for f in futures for ok in f.result(timeout=300)]
    assert scaled_up, f"still {engine_replicas()} after 150 s of load"
    assert right and all(right)
    deploy(bundle, TWO)
    wait_for_replicas(2)


def test_the_builder_takes_serve_run_arguments(bundle):
    """Through the call `serve run` and a Serve config make: `name=value` strings in."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as build_with

    from specrt.errors import SpecrtError

    application = build_with(app, {"bundle": str(bundle), "replicas": "2", "max_batch": "4"})
    assert isinstance(application, serve.Application)
    with pytest.raises(SpecrtError, match="unknown argument.*replica_count"):
        build_with(app, {"bundle": str(bundle), "replica_count": "2"})
    with pytest.raises(SpecrtError, match="bundle=PATH is required"):
        build_with(app, {"replicas": "2"})
    with pytest.raises(SpecrtError, match="min-replicas 3 and --max-replicas 2"):
        build_with(app, {"bundle": str(bundle), "min_replicas": "3", "max_replicas": "2"})


def test_engine_options_follow_the_settings(bundle):
    from specrt.serve.ray import engine_options

    settings = settings_for(bundle, max_queue=40)
    fixed = engine_options(settings, RayOptions(replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1}
    threads = engine_options(settings_for(bundle, threads=4), RayOptions())
    assert threads["ray_actor_options"] == {"num_cpus": 4}  # Ray reserves what the engines use
    assert fixed["max_ongoing_requests"] == 8 and fixed["max_queued_requests"] == 40
    scaled = engine_options(settings, RayOptions(min_replicas=0, max_replicas=4))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 0,
        "initial_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 4,  # one full batch per replica
    }


def test_the_serve_config_is_valid_for_ray():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[1] / "configs" / "ray-serve.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = config.applications
    assert application.import_path == "specrt.serve.ray:app"
    assert "bundle" in application.args


def test_without_ray_specrt_serve_is_untouched_and_ray_says_what_to_install(bundle):
    """Ray blocked from importing (as if the extra were not installed): the runtime, the
    local app and the CLI import without it, and --ray names the extra."""
    blocked = "import sys; sys.modules['ray'] = None; "
    check = (
        "import specrt.runtime, specrt.serve.app, specrt.cli; "
        "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules if sys.modules[m])"
    )
    subprocess.run([sys.executable, "-c", blocked + check], check=True, timeout=120)
    argv = ["specrt", "serve", str(bundle), "--ray"]
    run = blocked + f"from specrt.cli import main; sys.argv = {argv!r}; main()"
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "pip install 'specrt[ray]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_health_check_fails_when_the_engines_do(bundle, reference, tmp_path):
    """Ray's health check of a replica (its constructor needs a replica context, so the
    replica is made without it and given a real service)."""
    import shutil

    from specrt.serve.ray import EngineReplica
    from specrt.serve.service import LocalService

    replica = object.__new__(EngineReplica)
    replica.service = LocalService(settings_for(bundle), reference)
    replica.service.start()
    try:
        replica.check_health()
    finally:
        replica.service.stop()

    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / "target" / "tokenizer.json").write_text("{}")
    replica.service = LocalService(settings_for(broken))
    replica.service.load()
    with pytest.raises(RuntimeError, match="does not match its recorded sha256"):
        replica.check_health()


def test_a_replica_shutting_down_ends_what_it_still_runs(bundle, reference):
    """Ray's shutdown hook (`EngineReplica.__del__`, made without a replica context as
    above): a request still running ends as `specrt serve`'s drain ends it, its result's
    finish_reason "shutdown" (the stream's last chunk says so), a queued one fails with a 503,
    and the replica refuses what comes after."""
    import asyncio

    from specrt.serve.errors import APIError
    from specrt.serve.events import Delta, Done, Failed
    from specrt.serve.protocol import CompletionRequest
    from specrt.serve.ray import EngineReplica
    from specrt.serve.service import LocalService
    from specrt.serve.worker import Job

    replica = object.__new__(EngineReplica)
    replica.service = LocalService(replace(settings_for(bundle), max_batch=1), reference)

    async def last(job: Job):
        while isinstance(event := await job.next(), Delta):
            pass
        return event

    async def scenario() -> None:
        replica.service.start()
        jobs = [
            Job(reference.sequence(p, max_new_tokens=480, ignore_eos=True)) for p in PROMPTS[:2]
        ]
        for job in jobs:
            replica.service.worker.submit(job)
        assert isinstance(await jobs[0].next(), Delta)  # the first runs, the second waits
        await replica.__del__()
        running, queued = [await last(job) for job in jobs]
        assert isinstance(running, Done) and running.result.finish_reason == "shutdown"
        assert isinstance(queued, Failed) and queued.error.status == 503
        with pytest.raises(APIError, match="shutting down"):
            await replica.service.open(CompletionRequest(prompt="x", max_tokens=2))

    asyncio.run(scenario())
