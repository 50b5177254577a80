"""`kvstate serve` against `mlx_lm.server` under the same load, and a soak.

Both servers run the same model: the default GGUF (SmolLM2-135M-Instruct)
written as an mlx-lm directory with float32 layers (``kvstate.models.gguf.export_mlx_lm``;
mlx-lm cannot read GGUF), each started as its own process on localhost. N
concurrent streaming clients replay a fixed set of chat requests that share
one system prompt; each client sends its next request when the last one ends.
Reported per server and N: requests/s, completion tokens/s, time to first
token and inter-token latency (median and p99), failed requests (each with
its reason: an HTTP status and body, an error event, a broken stream, a
stream with no finish reason, or the client's ``--timeout``), and the
server's peak resident memory during that N (``VmHWM``, reset before each N).

    python -m benchmarks serve-load --clients 1 8 32 --requests 32
    python -m benchmarks serve-load --soak 600 --clients 32 --servers kvstate

``--soak S`` replays the set for S seconds at the first N (clients send no
new request after S; the ones in flight finish) and samples the server's
resident memory every 10 s; at the end it prints the memory after the
``--warmup`` (first, min, max, last and the least-squares slope in MiB per
minute) and request latency. The servers' own output goes to a log file whose
path is printed.
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
import tempfile
import time
from collections import Counter
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


def reset_peak(pid: int) -> None:
    """Start the process's peak resident memory (``VmHWM``) afresh (Linux ``clear_refs``)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak is since the server started


def report_failures(r: dict) -> None:
    """Each distinct failure reason with its count, and the first few as they came."""
    if not r["errors"]:
        return
    reasons = Counter(e.split(": ", 1)[1] for e in r["errors"])
    for reason, count in reasons.most_common():
        print(f"  failed x{count}: {reason}")
    for e in r["errors"][:5]:
        print(f"  first failures: {e}")


def mlx_memory(kind: str, url: str) -> str:
    """kvstate's ``/health`` memory figures (MLX's arrays and buffer cache), as text."""
    if kind != "kvstate":
        return ""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as h:
            m = json.load(h)["mlx_mib"]
    except (OSError, KeyError, ValueError) as e:
        return f"(health: {type(e).__name__}) "
    return f"mlx active {m['active']:6.1f} cache {m['cache']:6.1f} MiB  "


def soak(kind: str, pid: int, url: str, args) -> None:
    """Replay the set for ``args.soak`` seconds at the first N; print the server's
    resident memory every 10 s and, at the end, its growth after the warm-up."""
    samples: list = []
    n = args.clients[0]

    def tick(t, out):
        samples.append((t, *rss(pid)))
        print(
            f"  {t:6.0f} s  rss {samples[-1][1]:7.1f} MiB  {mlx_memory(kind, url)}"
            f"done {out['done']:5d}  failed {out['failed']}",
            flush=True,
        )

    reset_peak(pid)
    r = asyncio.run(load(url, n, 0, args.max_tokens, args.soak, tick, args.timeout))
    print(
        f"soak {kind}: N={n}, {r['seconds']:.0f} s, {r['done']} requests done, "
        f"{r['failed']} failed, {r['tokens']} tokens ({r['tokens'] / r['seconds']:.1f} tok/s); "
        f"request latency median {median(r['latency']):.1f} s, p95 "
        f"{pct(r['latency'], 0.95):.1f} s, max {max(r['latency'], default=float('nan')):.1f} s; "
        f"TTFT median {median(r['ttft']):.2f} s, ITL median {1000 * median(r['itl']):.0f} ms"
    )
    report_failures(r)
    warm = [s for s in samples if s[0] >= args.warmup] or samples
    if len(warm) >= 2:
        ts, ms = [s[0] for s in warm], [s[1] for s in warm]
        tm, mm = statistics.fmean(ts), statistics.fmean(ms)
        slope = sum((t - tm) * (m - mm) for t, m in zip(ts, ms)) / sum((t - tm) ** 2 for t in ts)
        print(
            f"  rss after the {args.warmup:.0f} s warm-up: first {ms[0]:.1f} MiB, "
            f"min {min(ms):.1f}, max {max(ms):.1f}, last {ms[-1]:.1f} MiB; "
            f"least-squares slope {60 * slope:+.2f} MiB/min over {len(ms)} samples; "
            f"peak (VmHWM) over the soak {samples[-1][2]:.1f} MiB"
        )


def start(kind: str, model_dir: Path, max_batch: int, extra: list) -> tuple:
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
            *extra,
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
    log = Path(tempfile.mkdtemp(prefix="serve_load_")) / f"{kind}.log"
    with open(log, "wb") as f:  # the server's own output, for a failure's cause
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    import urllib.request

    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port, log
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
    finish = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                fail(out, t0, f"HTTP {r.status}: {(await r.text())[:200]}")
                return
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    fail(out, t0, f"error event: {chunk['error']}")
                    return
                choice = chunk["choices"][0] if chunk["choices"] else {}
                if choice.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
                finish = choice.get("finish_reason") or finish
    except asyncio.TimeoutError:
        fail(out, t0, "the client's timeout (--timeout)")
        return
    except Exception as e:  # a broken stream is a failed request
        fail(out, t0, f"{type(e).__name__}: {e}")
        return
    if finish is None:
        fail(out, t0, "stream ended without a finish_reason")
        return
    if stamps:
        out["ttft"].append(stamps[0] - t0)
        out["itl"] += [b - a for a, b in zip(stamps, stamps[1:])]
    out["latency"].append(time.perf_counter() - t0)
    out["tokens"] += len(stamps)
    out["done"] += 1


def fail(out, t0, reason: str) -> None:
    """Count a failed request and keep why, and after how long, it failed."""
    out["failed"] += 1
    out["errors"].append(f"after {time.perf_counter() - t0:.1f} s: {reason}")


async def load(
    url,
    clients: int,
    requests: int,
    max_tokens: int,
    seconds: float = 0.0,
    on_tick=None,
    timeout_s: float = 600.0,
) -> dict:
    import aiohttp

    out = {"ttft": [], "itl": [], "latency": [], "errors": [], "tokens": 0, "done": 0, "failed": 0}
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

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client(session)) for _ in range(clients)]
        if on_tick:
            while not all(t.done() for t in tasks):
                await asyncio.sleep(10)
                on_tick(time.perf_counter() - t0, out)
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=32, help="requests per N (32)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--servers", nargs="+", default=["kvstate", "mlx-lm"])
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of soak at the first N")
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="client timeout per request, s (600)"
    )
    ap.add_argument(
        "--warmup", type=float, default=60.0, help="soak seconds before memory growth counts (60)"
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="an mlx-lm directory (default: the GGUF exported once, in --dtype)",
    )
    ap.add_argument("--dtype", default="float32", help="the export's dtype (bfloat16 on a GPU)")
    ap.add_argument("--kvstate-args", default="", help="extra `kvstate serve` flags, one string")
    args = ap.parse_args(argv)

    from kvstate.models import gguf
    from kvstate.models import load as models

    model_dir = args.model_dir
    if model_dir is None:
        import mlx.core as mx

        model_dir = models.cache_dir() / f"smollm2-135m-instruct-mlx-{args.dtype}"
        if not (model_dir / "config.json").is_file():
            gguf.export_mlx_lm(
                models.fetch(log=sys.stderr), model_dir, dtype=getattr(mx, args.dtype)
            )
    print(f"model: {model_dir}; {os.cpu_count()} cpus; max_tokens {args.max_tokens}")
    rows = []
    for kind in args.servers:
        proc, port, log = start(kind, model_dir, max(args.clients), args.kvstate_args.split())
        url = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(load(url, 1, 2, 4, 0))  # warm-up
            if args.soak:
                soak(kind, proc.pid, url, args)
                continue
            for n in args.clients:
                reset_peak(proc.pid)
                r = asyncio.run(
                    load(url, n, args.requests, args.max_tokens, timeout_s=args.timeout)
                )
                rows.append((kind, n, r, rss(proc.pid)[1]))
                print(
                    f"{kind} N={n}: {r['done'] / r['seconds']:.2f} req/s, "
                    f"{r['tokens'] / r['seconds']:.1f} tok/s, failed {r['failed']}, "
                    f"request latency median {median(r['latency']):.1f} s, "
                    f"max {max(r['latency'], default=float('nan')):.1f} s",
                    flush=True,
                )
                report_failures(r)
        finally:
            proc.terminate()
            proc.wait(60)
            print(f"  ({kind} server log: {log})", flush=True)
    if rows:
        print(
            "\n| server | N | req/s | tok/s | TTFT median / p99 s | ITL median / p99 ms "
            "| failed | peak RSS MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for kind, n, r, peak in rows:
            print(
                f"| {kind} | {n} | {r['done'] / r['seconds']:.2f} | "
                f"{r['tokens'] / r['seconds']:.1f} | {median(r['ttft']):.2f} / "
                f"{pct(r['ttft'], 0.99):.2f} | {1000 * median(r['itl']):.0f} / "
                f"{1000 * pct(r['itl'], 0.99):.0f} | {r['failed']} | {peak:.0f} |"
            )


if __name__ == "__main__":
    main()
