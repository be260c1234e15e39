"""`specrt serve` as an operator runs it: a real process, stopped by a real signal, its log read
back. SIGTERM drains (no new requests, those in flight finish, what still runs at the drain
timeout ends with a last chunk that says so), and every request's id comes back and is logged.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path

import openai
import pytest
from servers import CliServer, client, http

from specrt.exporter.build import build_bundle

DRAIN = 3.0  # --drain-timeout of the test: far less than the long streams take


@pytest.fixture(scope="module")
def bundle(pairs, tmp_path_factory) -> Path:
    """The tiny llama pair with room for streams of 8,000 tokens: longer than the drain on any
    machine (the tiny pair writes a few hundred tokens a second here)."""
    root = tmp_path_factory.mktemp("lifecycle")
    for role, folder in zip(("draft", "target"), pairs["llama"], strict=True):
        shutil.copytree(folder, root / role)
        config = json.loads((root / role / "config.json").read_text())
        config["max_position_embeddings"] = 8192  # rotary positions: any length will do
        (root / role / "config.json").write_text(json.dumps(config))
    draft, target = str(root / "draft"), str(root / "target")
    return build_bundle(draft, target, root / "tiny", max_context=8192, log=lambda _: None)


class RawStream:
    """A streamed completion on a connection of its own, read as raw server-sent events (the
    official client stops at an error event; this also sees the `[DONE]` after it)."""

    def __init__(self, base: str, max_tokens: int):
        self.connection = HTTPConnection(base.removeprefix("http://"), timeout=60)
        body = {"prompt": "def fibonacci(n):", "max_tokens": max_tokens, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        headers = {"Content-Type": "application/json"}
        self.connection.request("POST", "/v1/completions", json.dumps(body), headers)
        self.response = self.connection.getresponse()
        assert self.response.status == 200
        self.events: list[str] = []
        self._read(until_first=True)

    def _read(self, until_first: bool = False) -> None:
        while line := self.response.readline():
            if line.startswith(b"data: "):
                self.events.append(line[6:].decode().strip())
                if until_first:
                    return

    def rest(self) -> list[str]:
        """Every event, read to the end of the response."""
        self._read()
        self.connection.close()
        return self.events


def test_sigterm_drains_then_ends_what_still_runs_with_a_last_chunk(bundle):
    """Two long streams and a short one in flight, then SIGTERM: new requests get a 503 with
    Retry-After, /health says draining, the short stream finishes as usual, the long ones end
    at the drain timeout with a last chunk (finish_reason "shutdown"), an OpenAI error event
    and [DONE], and the process exits 0 within the drain timeout. (Before: uvicorn waited 30 s,
    then cut the streams with none of that, and a new request met a closed socket.)"""
    with CliServer(bundle, "--drain-timeout", str(DRAIN)) as server:
        streams = [RawStream(server.base, 8000), RawStream(server.base, 8000)]
        short = RawStream(server.base, 24)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        with ThreadPoolExecutor(3) as pool:
            ends = [pool.submit(stream.rest) for stream in [*streams, short]]
            time.sleep(0.3)  # the server's tick (ten a second) has seen the signal
            status, health = http(f"{server.base}/health")
            assert status == 503 and health["status"] == "draining"
            with pytest.raises(openai.APIStatusError) as refused:
                client(server.base).completions.create(model="tiny", prompt="x", max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"] == "1"
            assert refused.value.body["code"] == "shutting_down"
            events = [end.result() for end in ends]
        assert server.process.wait(DRAIN + 5) == 0
        assert time.monotonic() - signalled < DRAIN + 1.5
    for long in events[:2]:
        *chunks, last, error, done = long
        assert done == "[DONE]"
        assert json.loads(error)["error"]["code"] == "shutting_down"
        assert json.loads(last)["choices"][0]["finish_reason"] == "shutdown"
        assert 1 < len(chunks) < 8000 and not any("error" in json.loads(c) for c in chunks)
    *_, last, done = events[2]
    assert done == "[DONE]" and json.loads(last)["choices"][0]["finish_reason"] == "length"


def test_a_second_signal_ends_at_once(bundle):
    with CliServer(bundle, "--drain-timeout", "60") as server:
        stream = RawStream(server.base, 8000)
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert http(f"{server.base}/health")[1]["status"] == "draining"
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        server.process.wait(10)
        assert time.monotonic() - signalled < 5
        stream.connection.close()


def test_every_request_has_an_id_that_comes_back_and_is_logged(bundle):
    """The client's X-Request-Id comes back and names the request's log lines (uvicorn's
    access line and the worker's); without one, or with one that could forge a log line, the
    server makes one. Errors carry it too."""
    with CliServer(bundle) as server:
        api = client(server.base)
        given = api.completions.with_raw_response.create(
            model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "req-42.a"}
        )
        assert given.headers["x-request-id"] == "req-42.a"
        made = api.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
        forged = api.completions.with_raw_response.create(
            model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "a\tb c"}
        )
        assert re.fullmatch(r"[0-9a-f]{32}", forged.headers["x-request-id"])
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(
                model="tiny", prompt="x", top_p=3, extra_headers={"X-Request-Id": "bad-1"}
            )
        assert refused.value.response.headers["x-request-id"] == "bad-1"
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
        lines = server.output().splitlines()
    ours = [line for line in lines if "[req-42.a]" in line]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in ours), lines
    assert any("finished (length)" in line for line in ours), lines
    assert any("[bad-1]" in line and " 400" in line for line in lines), lines
    made_id = made.headers["x-request-id"]
    assert any(f"[{made_id}]" in line and "finished" in line for line in lines), lines
