"""What `specrt serve` costs one client: tokens/s and time to first token through the server
against the Python API on the same bundle, prompts and controller, side by side in one run.

    python benchmarks/serve_overhead.py BUNDLE [--prompts F.jsonl ...] [--max-new-tokens 128]
        [--controllers adaptive,fixed:4] [--out benchmarks/results/cpu-serve-overhead]

The server runs as its own process (`specrt serve`, as a user starts it); the Python API runs
in this process. Both are timed the same way, from the caller's side: from the call to the first
text and to the last. Runs alternate between the two for every prompt so that the machine's
drift touches both alike. Greedy, EOS ignored, so every run has the same length; outputs must be
identical. A prompt that carries a "prediction" sends it both ways (Predicted Outputs).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from specrt import machine
from specrt.files import portable, write_json_atomic
from specrt.runtime import SpeculativeRuntime
from specrt.tools.prompts import load_prompts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(bundle: Path, port: int, *options: str) -> subprocess.Popen:
    """`specrt serve BUNDLE --port PORT [options]` as its own process, once it is healthy."""
    command = [sys.executable, "-m", "specrt.cli", "serve", str(bundle), "--port", str(port)]
    command.append("--no-prompt-cache")  # as the API beside it: every prompt computed whole
    process = subprocess.Popen(
        [*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("specrt serve exited during start-up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return process
        except OSError:  # not listening yet, or (Ray Serve) not routed yet: a 404
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("specrt serve did not become healthy in 10 minutes")


def through_api(rt: SpeculativeRuntime, item: dict, max_new: int, controller: str) -> dict:
    start = time.perf_counter()
    generation = rt.stream(
        item.get("messages") or item["prompt"],
        max_new_tokens=max_new,
        controller=controller,
        ignore_eos=True,
        prediction=item.get("prediction"),
    )
    first = None
    for _ in generation:
        first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = len(generation.result.token_ids)
    return {"text": generation.result.text, "tokens": tokens, "ttft": first - start,
            "seconds": end - start}  # fmt: skip


def through_server(api: openai.OpenAI, model: str, item: dict, max_new: int, controller: str):
    options = dict(
        model=model,
        max_tokens=max_new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": controller, "ignore_eos": True},
    )
    if item.get("prediction") is not None:
        options["extra_body"]["prediction"] = {"type": "content", "content": item["prediction"]}
    chat = "messages" in item
    start = time.perf_counter()
    if chat:
        stream = api.chat.completions.create(messages=item["messages"], **options)
    else:
        stream = api.completions.create(prompt=item["prompt"], **options)
    first, text, usage = None, [], None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
        if piece:
            first = first or time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": usage.completion_tokens, "ttft": first - start,
            "seconds": end - start}  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    return {
        "tokens_per_s": tokens / seconds,
        "ttft_ms_mean": 1000 * statistics.mean(r["ttft"] for r in runs),
        "ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in runs),
        "new_tokens": tokens,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--prompts", type=Path, nargs="*", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--controllers", default="adaptive,fixed:4")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-serve-overhead"))
    args = parser.parse_args()
    files = args.prompts or sorted(Path("benchmarks/prompts").glob("*.jsonl"))
    prompts = load_prompts(files)
    port = free_port()
    server = start_server(args.bundle, port)
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
        model = api.models.list().data[0].id
        rt = SpeculativeRuntime.load(args.bundle, prompt_cache=False)
        rows = []
        for controller in args.controllers.split(","):
            through_api(rt, prompts[0], 8, controller)  # warm-ups
            through_server(api, model, prompts[0], 8, controller)
            direct, served, identical = [], [], 0
            for i, item in enumerate(prompts):
                a = through_api(rt, item, args.max_new_tokens, controller)
                b = through_server(api, model, item, args.max_new_tokens, controller)
                direct.append(a)
                served.append(b)
                identical += a["text"] == b["text"]
                print(f"{controller:9} prompt {i + 1}/{len(prompts)}  api "
                      f"{a['tokens'] / a['seconds']:6.2f} tok/s  server "
                      f"{b['tokens'] / b['seconds']:6.2f} tok/s", flush=True)  # fmt: skip
            api_row, server_row = summarize(direct), summarize(served)
            rows.append({
                "controller": controller,
                "python_api": api_row,
                "server": server_row,
                "server_vs_api_tokens_per_s": server_row["tokens_per_s"] / api_row["tokens_per_s"],
                "ttft_overhead_ms": server_row["ttft_ms_mean"] - api_row["ttft_ms_mean"],
                "identical_outputs": f"{identical}/{len(prompts)}",
            })  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    result = {
        "bundle": str(args.bundle),
        "precision": rt.bundle.precision_label,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "machine": machine.describe(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out.with_suffix(".json"), portable(result))
    lines = [
        f"# specrt serve vs the Python API, one client ({result['precision']}, "
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens, greedy)",
        "",
        f"{machine.label(result['machine'])}; {result['machine']['date']}.",
        "",
        "| controller | API tok/s | server tok/s | server/API | API TTFT ms | server TTFT ms "
        "| identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, s = r["python_api"], r["server"]
        lines.append(
            f"| {r['controller']} | {a['tokens_per_s']:.2f} | {s['tokens_per_s']:.2f} | "
            f"{r['server_vs_api_tokens_per_s']:.3f} | {a['ttft_ms_mean']:.0f} | "
            f"{s['ttft_ms_mean']:.0f} | {r['identical_outputs']} |"
        )
    args.out.with_suffix(".md").write_text(portable("\n".join(lines) + "\n"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
