"""What Ray Serve costs one client, and what a second replica gives, on one box.

    python benchmarks/ray_serve.py BUNDLE [--prompts F.jsonl ...] [--max-new-tokens 128]
        [--clients 16] [--rounds 2] [--out benchmarks/results/cpu-ray-serve]

1. One client: `specrt serve` and `specrt serve --ray --replicas 1` run side by side, each as
   its own process with all cores, and each prompt goes to both in turn (which one first
   alternates), streamed, greedy, EOS ignored, timed from the caller's side: tokens/s and time
   to first token. Only one server works at a time, and outputs must be identical.
2. Saturation: `--clients` closed-loop clients, `--rounds` requests each, through
   `specrt serve --ray` with 1 replica (all cores) and then 2 replicas (half the cores each):
   completed requests per second and aggregate tokens/s, every output compared with the one
   `specrt serve` gave the client of part 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from serve_overhead import free_port, start_server, summarize, through_server

from specrt import machine
from specrt.files import portable, write_json_atomic
from specrt.tools.prompts import load_prompts


def connect(port: int) -> tuple[openai.OpenAI, str]:
    api = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=900, max_retries=0
    )
    return api, api.models.list().data[0].id


def stop(process) -> None:
    process.terminate()
    process.wait(180)


def one_client(bundle: Path, prompts: list[dict], max_new: int) -> tuple[dict, list[str]]:
    local_port, ray_port = free_port(), free_port()
    local = start_server(bundle, local_port)
    on_ray = start_server(bundle, ray_port, "--ray", "--replicas", "1")
    try:
        paths = {"serve": connect(local_port), "ray": connect(ray_port)}
        for api, model in paths.values():  # warm-ups
            through_server(api, model, prompts[0], 8, "adaptive")
        runs = {"serve": [], "ray": []}
        for i, item in enumerate(prompts):
            for name in ("serve", "ray") if i % 2 == 0 else ("ray", "serve"):
                api, model = paths[name]
                runs[name].append(through_server(api, model, item, max_new, "adaptive"))
            a, b = runs["serve"][-1], runs["ray"][-1]
            print(f"prompt {i + 1}/{len(prompts)}  serve {a['tokens'] / a['seconds']:6.2f} "
                  f"tok/s  ray {b['tokens'] / b['seconds']:6.2f} tok/s", flush=True)  # fmt: skip
    finally:
        stop(local)
        stop(on_ray)
    texts = [r["text"] for r in runs["serve"]]
    identical = sum(a == b["text"] for a, b in zip(texts, runs["ray"], strict=True))
    serve_row, ray_row = summarize(runs["serve"]), summarize(runs["ray"])
    row = {
        "specrt_serve": serve_row,
        "ray": ray_row,
        "ray_vs_serve_tokens_per_s": ray_row["tokens_per_s"] / serve_row["tokens_per_s"],
        "ttft_overhead_ms": ray_row["ttft_ms_mean"] - serve_row["ttft_ms_mean"],
        "identical_outputs": f"{identical}/{len(prompts)}",
    }
    return row, texts


def saturate(bundle, prompts, texts, max_new, replicas, clients, rounds) -> dict:
    """Closed loop: every client sends its next request as soon as the last one ends."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // replicas)
    port = free_port()
    options = ["--ray", "--replicas", str(replicas), "--threads", str(threads)]
    server = start_server(bundle, port, *options)
    try:
        api, model = connect(port)
        through_server(api, model, prompts[0], 8, "adaptive")  # warm-up

        def client(c: int) -> list[tuple[int, dict]]:
            picks = [(c * rounds + r) % len(prompts) for r in range(rounds)]
            return [(i, through_server(api, model, prompts[i], max_new, "adaptive")) for i in picks]

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = [run for runs in pool.map(client, range(clients)) for run in runs]
        seconds = time.perf_counter() - start
    finally:
        stop(server)
    latencies = [run["seconds"] for _, run in done]
    return {
        "replicas": replicas,
        "threads_per_replica": threads,
        "clients": clients,
        "requests": len(done),
        "seconds": seconds,
        "requests_per_s": len(done) / seconds,
        "tokens_per_s": sum(run["tokens"] for _, run in done) / seconds,
        "latency_s_median": statistics.median(latencies),
        "identical_to_one_client": f"{sum(texts[i] == run['text'] for i, run in done)}/{len(done)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--prompts", type=Path, nargs="*", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-ray-serve"))
    args = parser.parse_args()
    files = args.prompts or sorted(Path("benchmarks/prompts").glob("*.jsonl"))
    prompts = load_prompts(files)
    one, texts = one_client(args.bundle, prompts, args.max_new_tokens)
    saturation = [
        saturate(args.bundle, prompts, texts, args.max_new_tokens, n, args.clients, args.rounds)
        for n in (1, 2)
    ]
    result = {
        "bundle": str(args.bundle),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "machine": machine.describe(),
        "one_client": one,
        "saturation": saturation,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out.with_suffix(".json"), portable(result))
    s, r = one["specrt_serve"], one["ray"]
    lines = [
        f"# specrt serve on Ray Serve ({len(prompts)} prompts x {args.max_new_tokens} tokens, "
        "greedy, adaptive)",
        "",
        f"{machine.label(result['machine'])}; {result['machine']['date']}.",
        "",
        "One client, side by side:",
        "",
        "| path | tok/s | TTFT mean ms | TTFT median ms |",
        "|---|---|---|---|",
        f"| specrt serve | {s['tokens_per_s']:.2f} | {s['ttft_ms_mean']:.0f} | "
        f"{s['ttft_ms_median']:.0f} |",
        f"| specrt serve --ray (1 replica) | {r['tokens_per_s']:.2f} | {r['ttft_ms_mean']:.0f} | "
        f"{r['ttft_ms_median']:.0f} |",
        "",
        f"Ray / serve: {one['ray_vs_serve_tokens_per_s']:.3f} tokens/s, "
        f"{one['ttft_overhead_ms']:+.0f} ms TTFT; identical outputs {one['identical_outputs']}.",
        "",
        f"Saturation, {args.clients} closed-loop clients x {args.rounds} requests:",
        "",
        "| replicas | threads each | requests/s | tok/s | median latency s | identical |",
        "|---|---|---|---|---|---|",
    ]
    for row in saturation:
        lines.append(
            f"| {row['replicas']} | {row['threads_per_replica']} | {row['requests_per_s']:.3f} | "
            f"{row['tokens_per_s']:.2f} | {row['latency_s_median']:.1f} | "
            f"{row['identical_to_one_client']} |"
        )
    args.out.with_suffix(".md").write_text(portable("\n".join(lines) + "\n"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
