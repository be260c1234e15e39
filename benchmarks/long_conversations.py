"""Many long conversations at once on one box: N chat requests of S prompt tokens each, sent
together to a real `specrt serve` process through the official client, and what the server
holds in memory while it serves them (its peak resident set, from /proc).

Each prompt is a different cut of specrt's own source (long_context.py's text) with a question
after it, so no prompt reuses another's prefix; greedy, a few new tokens each. The server runs
with its defaults (its KV budget, prefix store and slots as `specrt serve` sets them) unless
the flags below say otherwise.

    python benchmarks/long_conversations.py BUNDLE [--conversations 8] [--size 8000] \
        [--max-new-tokens 16] [--kv-budget SPEC]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import openai
from long_context import QUESTION, source_text

from specrt import machine
from specrt.bundle import Bundle
from specrt.runtime.text import TextTokenizer
from specrt.tools.llamacpp import _free_port


def peak_memory(pid: int) -> dict:
    """The process's peak and current resident set, MB (Linux's VmHWM and VmRSS)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def prompts(bundle: Path, count: int, size: int) -> list[str]:
    """count prompts of about size tokens, each from its own stretch of the text."""
    tokenizer = TextTokenizer.from_bundle(Bundle.load(bundle))
    ids = tokenizer.encode(source_text() * (1 + count * size // 20000))
    step = max(1, (len(ids) - size) // max(1, count - 1))
    return [tokenizer.decode(ids[i * step : i * step + size]) + QUESTION for i in range(count)]


@click.command()
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--conversations", default=8, show_default=True)
@click.option("--size", default=8000, show_default=True, help="Prompt tokens each.")
@click.option("--max-new-tokens", default=16, show_default=True)
@click.option("--kv-budget", default=None, help="Passed to specrt serve.")
def main(bundle: Path, conversations: int, size: int, max_new_tokens: int, kv_budget) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "specrt.cli", "serve", str(bundle), "--port", str(port)]
    command += ["--max-batch", str(conversations), "--model-name", "b", "--timeout", "0"]
    command += ["--kv-budget", kv_budget] if kv_budget else []
    server = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
                    if json.load(reply).get("status") == "ok":
                        break
            except OSError:
                pass
            time.sleep(1)
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=7200)
        card = api.models.retrieve("b").model_extra
        loaded = peak_memory(server.pid)
        texts = prompts(bundle, conversations, size)

        def ask(text: str) -> dict:
            sent = time.perf_counter()
            reply = api.chat.completions.create(
                model="b",
                messages=[{"role": "user", "content": text}],
                max_tokens=max_new_tokens,
                temperature=0,
            )
            return {
                "prompt_tokens": reply.usage.prompt_tokens,
                "seconds": time.perf_counter() - sent,
            }

        start = time.perf_counter()
        with ThreadPoolExecutor(conversations) as pool:
            done = list(pool.map(ask, texts))
        result = {
            "machine": machine.label(machine.describe()),
            "command": " ".join(command[2:]),
            "kv_budget": card.get("kv_budget"),
            "prefix_cache_bytes": card.get("prefix_cache_bytes"),
            "loaded_mb": loaded,
            "served_mb": peak_memory(server.pid),
            "seconds": round(time.perf_counter() - start, 1),
            "requests": done,
        }
        print(json.dumps(result, indent=1))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
