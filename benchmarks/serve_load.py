"""`kvstate serve` against `mlx_lm.server` under the same load, and a soak.

Both servers run the same model: the default GGUF (SmolLM2-135M-Instruct)
written as an mlx-lm directory with float32 layers (``kvstate.gguf.export_mlx_lm``;
mlx-lm cannot read GGUF), each started as its own process on localhost. N
concurrent streaming clients replay a fixed set of chat requests that share
one system prompt; each client sends its next request when the last one ends.
Reported per server and N: requests/s, completion tokens/s, time to first
token and inter-token latency (median and p95), failed requests, and the
server's peak resident memory (``VmHWM``).

    python benchmarks/serve_load.py --clients 1 8 32 --requests 32
    python benchmarks/serve_load.py --soak 600 --clients 32 --servers kvstate

``--soak S`` replays the set for S seconds at the first N and samples the
server's resident memory every 10 s: growth shows as a rising RSS after the
warm-up, a failure as a non-200 reply or a broken stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEM = (
    "You are a helpful assistant for a small bookshop. Answer briefly and politely, "
    "in one or two sentences, and never invent facts you are not sure of."
)
QUESTIONS = [
    "What is the capital of France?",
    "Recommend a classic novel.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "How do I return a book?",
    "What is a haiku?",
    "Who wrote Hamlet?",
    "Suggest a book for a ten-year-old.",
    "What is the boiling point of water?",
    "Translate 'thank you' into Spanish.",
    "What day comes after Monday?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Name a famous painter.",
    "What is the largest ocean?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> tuple:
    """(current, peak) resident memory of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def start(kind: str, model_dir: Path, max_batch: int) -> tuple:
    port = free_port()
    if kind == "kvstate":
        cmd = [
            sys.executable,
            "-m",
            "kvstate",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--max-batch",
            str(max_batch),
            "--max-queue",
            "1024",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--decode-concurrency",
            str(max_batch),
            "--log-level",
            "WARNING",
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError as e:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{kind} server did not start: {' '.join(cmd)}") from e
            time.sleep(0.5)


async def one(session, url, question, max_tokens, out):
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps = []
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                out["failed"] += 1
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
    except Exception:  # a broken stream is a failed request
        out["failed"] += 1
        return
    if stamps:
        out["ttft"].append(stamps[0] - t0)
        out["itl"] += [b - a for a, b in zip(stamps, stamps[1:])]
    out["tokens"] += len(stamps)
    out["done"] += 1


async def load(
    url, clients: int, requests: int, max_tokens: int, seconds: float = 0.0, on_tick=None
) -> dict:
    import aiohttp

    out = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "failed": 0}
    next_i = iter(range(10**9))
    stop_at = time.perf_counter() + seconds if seconds else None

    async def client(session):
        while True:
            i = next(next_i)
            if stop_at is None and i >= requests:
                return
            if stop_at is not None and time.perf_counter() > stop_at:
                return
            await one(session, url, QUESTIONS[i % len(QUESTIONS)], max_tokens, out)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client(session)) for _ in range(clients)]
        if on_tick:
            while not all(t.done() for t in tasks):
                await asyncio.sleep(10)
                on_tick(time.perf_counter() - t0)
        await asyncio.gather(*tasks)
        out["seconds"] = time.perf_counter() - t0
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per N (32)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--servers", nargs="+", default=["kvstate", "mlx-lm"])
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of soak at the first N")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="an mlx-lm directory (default: the GGUF exported once, float32)",
    )
    args = ap.parse_args()

    from kvstate import gguf, models

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = models.cache_dir() / "smollm2-135m-instruct-mlx-float32"
        if not (model_dir / "config.json").is_file():
            gguf.export_mlx_lm(models.fetch(log=sys.stderr), model_dir)
    print(f"model: {model_dir}; {os.cpu_count()} cpus; max_tokens {args.max_tokens}")
    rows = []
    for kind in args.servers:
        proc, port = start(kind, model_dir, max(args.clients))
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(load(url, 1, 2, 4, 0))  # warm-up
            if args.soak:
                samples = []

                def tick(t, pid=proc.pid, samples=samples):
                    samples.append((t, *rss(pid)))
                    print(f"  {t:6.0f} s  rss {samples[-1][1]:7.1f} MiB", flush=True)

                r = asyncio.run(load(url, args.clients[0], 0, args.max_tokens, args.soak, tick))
                print(
                    f"soak {kind}: N={args.clients[0]}, {r['seconds']:.0f} s, {r['done']} "
                    f"requests done, {r['failed']} failed, {r['tokens']} tokens"
                )
                warm = [s for s in samples if s[0] >= 60] or samples
                print(
                    f"  rss after warm-up {warm[0][1]:.1f} MiB, at the end {samples[-1][1]:.1f}"
                    f" MiB, peak {samples[-1][2]:.1f} MiB"
                )
                continue
            for n in args.clients:
                r = asyncio.run(load(url, n, args.requests, args.max_tokens))
                rows.append((kind, n, r, rss(proc.pid)[1]))
                print(
                    f"{kind} N={n}: {r['done'] / r['seconds']:.2f} req/s, "
                    f"{r['tokens'] / r['seconds']:.1f} tok/s, failed {r['failed']}",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(60)
    if rows:
        print(
            "\n| server | N | req/s | tok/s | TTFT median / p95 s | ITL median / p95 ms "
            "| failed | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for kind, n, r, peak in rows:
            print(
                f"| {kind} | {n} | {r['done'] / r['seconds']:.2f} | "
                f"{r['tokens'] / r['seconds']:.1f} | {median(r['ttft']):.2f} / "
                f"{pct(r['ttft'], 0.95):.2f} | {1000 * median(r['itl']):.0f} / "
                f"{1000 * pct(r['itl'], 0.95):.0f} | {r['failed']} | {peak:.0f} |"
            )


if __name__ == "__main__":
    main()
