"""Helpers for tests that talk to a real server: uvicorn in a thread on a free loopback port,
raw HTTP for requests a client would refuse to send, the official client, the metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specrt.runtime import SpeculativeRuntime
from specrt.serve import ServeSettings, create_app


def until(ready, timeout: float, message: str, every: float = 0.05):
    """What `ready()` returns once it is truthy, polled every `every` seconds; fails with
    `message` after `timeout`. A test's waits end on a state, and are bounded."""
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        assert time.monotonic() < deadline, message
        time.sleep(every)
    return value


def free_port() -> int:
    """A loopback port nobody listens on now (for servers that bind it themselves)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(settings: ServeSettings, runtime: SpeculativeRuntime | None = None, app=None):
    """uvicorn in a thread on a free 127.0.0.1 port; yields (base URL, the app)."""
    app = app or create_app(settings, runtime)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    until(lambda: server.started or not thread.is_alive(), 60, "the server did not start", 0.01)
    assert server.started, "the server's thread ended before it started"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class CliServer:
    """`specrt serve` in a process of its own on a free loopback port; `output()` is what it
    printed (stdout and stderr, kept in a file so a full pipe never stalls it)."""

    def __init__(self, bundle, *options: str, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by __exit__)
        command = [sys.executable, "-m", "specrt.cli", "serve", str(bundle)]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port), *options],
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_healthy(self, timeout: float = 120) -> None:
        until(self._healthy, timeout, "specrt serve did not become healthy", 0.2)

    def _healthy(self) -> bool:
        assert self.process.poll() is None, self.output()
        try:
            return http(f"{self.base}/health")[0] == 200
        except OSError:
            return False

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def __enter__(self) -> CliServer:
        self.wait_healthy()
        return self

    def __exit__(self, *_) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self._log.close()


def wait_healthy(base: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, body = http(f"{base}/health")
        if status == 200 or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def http(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(base: str, key: str = "none", **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, **options)


def metric_values(base: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return values
