"""Serving benchmark: the OpenAI-compatible server under a stream of concurrent requests, measured from the client
(time to first token, time per output token, end-to-end latency, throughput), beside the engine alone on the same
kind of work (``Engine.generate`` with every request submitted at once: no HTTP, no streaming) and beside the
server's own latency histograms (/metrics).

    python3 bench/bench_serve.py [--requests 32] [--rate inf] [--prompt-len 128] [--max-tokens 64]
                                 [--warmup-requests N] [--out PATH]
                                 [any `openk3 serve` model / engine option, e.g. --ckpt DIR --max-seqs 64]

Requests are token-id prompts (random, a fresh set for each of the two runs, so that neither reuses the other's
cached prefixes) with ``ignore_eos`` and a fixed ``max_tokens``, streamed (server-sent events) with
``stream_options.include_usage``. ``--rate`` is the mean arrival rate in requests per second (Poisson arrivals,
seeded); ``inf`` sends them all at once. Runs on CPU (the default ``tiny`` model) or on a GPU. Prints one table
and writes JSON (default ``$OUT/serve.json`` or ``bench/out/serve.json``).

Warm-up: before each timed run (the engine alone, then the server) ``--warmup-requests`` requests of the same
lengths run untimed, all at once (default: as many as the timed run on a GPU, where the first batches of each size
compile and autotune kernels -- Triton, fla's chunked prefill -- and take seconds; 2 on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, linear between order statistics; NaN for no values."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stub_forward() -> None:
    """Every engine of this process decodes with fixed logits instead of the model (``--stub-forward``): the
    prefill still runs the model, the decode step costs only the engine's host work, sampling and the streams."""
    import torch

    from openk3.infer.engine import Engine

    fixed = {}

    def stub(self, meta, lengths, table, B, ids_from=None):
        key = id(self)
        if key not in fixed:
            g = torch.Generator().manual_seed(0)
            V = self.mcfg.vocab_size
            fixed[key] = torch.randn(self.cfg.max_seqs, V, generator=g).to(self.device)
        return fixed[key][:B].clone()

    Engine._decode_logits = stub


def _start_server(serve_args: list[str], stub: bool = False):
    """``openk3 serve`` in its own process (the load client must not share the server's GIL); ``stub``: with
    :func:`_stub_forward` applied in that process."""
    import httpx

    port = _free_port()
    entry = [os.path.abspath(__file__), "--serve-stubbed"] if stub else ["-m", "openk3"]
    cmd = [
        sys.executable,
        *entry,
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *serve_args,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # (CUDA graphs and autotuning at start-up)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            now = time.perf_counter()
            if d.get("choices") and d["choices"][0].get("text"):
                first = first if first is not None else now
                last = now
                chunks += 1
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {
        "ttft": (first - t0) if first is not None else math.nan,
        "tpot": (last - first) / (tokens - 1) if first is not None and tokens > 1 else math.nan,
        "e2e": end - t0,
        "tokens": tokens,
        "chunks": chunks,  # data events with text (a chunk carries several tokens when the server fell behind)
    }


async def _load_test(url: str, model: str, prompts, max_tokens: int, rate: float, seed: int):
    import httpx

    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *(_one(client, url, model, p, max_tokens, d) for p, d in zip(prompts, delays))
        )
        return res, time.perf_counter() - t0


def _server_histograms(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each openk3 histogram on /metrics (the server's own view)."""
    import httpx

    out: dict[str, list[float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        for part, i in (("_sum", 0), ("_count", 1)):
            if not line.startswith("#") and name.endswith("_seconds" + part):
                out.setdefault(name[len("openk3_") : -len(part)], [0.0, 0.0])[i] = float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument(
        "--rate", type=float, default=math.inf, help="mean arrivals per second (inf: all at once)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help="untimed requests of the same lengths before each timed run (default: --requests on a GPU, 2 on CPU)",
    )
    ap.add_argument(
        "--stub-forward",
        action="store_true",
        help="decode with fixed logits instead of the model (engine alone and server): what the engine's host "
        "work, the HTTP side and the streams deliver when the model costs nothing",
    )
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args(argv)
    if args.requests < 1 or args.prompt_len < 1 or args.max_tokens < 1:
        raise SystemExit("--requests, --prompt-len and --max-tokens must be >= 1")
    if args.warmup_requests is not None and args.warmup_requests < 0:
        raise SystemExit(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not (args.rate > 0):
        raise SystemExit(f"--rate must be > 0 (inf: all at once), got {args.rate}")

    from openk3.cli import build_parser
    from openk3.infer.cli import _load
    from openk3.infer.sampling import SamplingParams

    sargs = build_parser().parse_args(["serve", *rest])
    if args.stub_forward:
        _stub_forward()
    engine, name, _source = _load(sargs)
    if engine.graphs_enabled:
        engine.capture_graphs()
    vocab, ctx, max_seqs = engine.tok_vocab, engine.max_model_len, engine.cfg.max_seqs
    need = args.prompt_len + args.max_tokens
    if need > ctx:
        raise SystemExit(f"--prompt-len + --max-tokens = {need} exceeds the context ({ctx})")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    dev = str(next(engine.model.parameters()).device)
    warm_n = args.warmup_requests
    if warm_n is None:
        warm_n = args.requests if dev.startswith("cuda") else 2
    # the engine alone (after a warm-up: compilation, autotuning, first-call costs)
    if warm_n:
        engine.generate(_prompts(warm_n, args.prompt_len, vocab, args.seed + 7), params)
    t0 = time.perf_counter()
    reqs = engine.generate(_prompts(args.requests, args.prompt_len, vocab, args.seed + 1), params)
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(r.output_ids) for r in reqs)
    del engine, reqs  # (one copy of the model at a time on the device)
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    proc, url = _start_server(rest, stub=args.stub_forward)
    try:
        import httpx

        warm = {
            "model": name,
            "prompt": _prompts(1, args.prompt_len, vocab, args.seed + 7)[0],
            "max_tokens": 4,
        }
        httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()
        if warm_n > 1:  # the server's own process compiles and autotunes anew
            asyncio.run(
                _load_test(
                    url,
                    name,
                    _prompts(warm_n, args.prompt_len, vocab, args.seed + 8),
                    args.max_tokens,
                    math.inf,
                    args.seed,
                )
            )
        before = _server_histograms(url)
        res, wall = asyncio.run(
            _load_test(
                url,
                name,
                _prompts(args.requests, args.prompt_len, vocab, args.seed + 2),
                args.max_tokens,
                args.rate,
                args.seed,
            )
        )
        after = _server_histograms(url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    server = {}
    for k, (total, count) in after.items():
        t0_, c0 = before.get(k, (0.0, 0.0))
        server[k] = (total - t0_) / (count - c0) if count > c0 else math.nan

    tokens = sum(r["tokens"] for r in res)
    ttft = [r["ttft"] for r in res if not math.isnan(r["ttft"])]
    tpot = [r["tpot"] for r in res if not math.isnan(r["tpot"])]
    e2e = [r["e2e"] for r in res]
    print(
        f"\nserving {name}{' (decode stubbed: fixed logits)' if args.stub_forward else ''} on {dev}: "
        f"{args.requests} requests, prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} new tokens each, rate {args.rate:g}/s, max_seqs {max_seqs}\n"
    )
    print("| measure | p50 | p90 | p99 | mean | server's mean (/metrics) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = (
        ("time to first token (ms)", ttft, "time_to_first_token_seconds"),
        ("time per output token (ms)", tpot, "time_per_output_token_seconds"),
        ("end-to-end latency (ms)", e2e, "e2e_request_latency_seconds"),
    )
    for label, xs, key in rows:
        qs = [1e3 * _pct(xs, q) for q in (0.5, 0.9, 0.99)]
        mean = 1e3 * statistics.fmean(xs) if xs else math.nan
        print(
            f"| {label} | {qs[0]:.1f} | {qs[1]:.1f} | {qs[2]:.1f} | {mean:.1f} | {1e3 * server.get(key, math.nan):.1f} |"
        )
    ratio = (
        f"the server reaches {100 * (tokens / wall) / (offline_tokens / offline_s):.0f} % of it"
        if math.isinf(args.rate)
        else "(the server's rate is bounded by the arrivals here: compare with --rate inf)"
    )
    chunks = sum(r["chunks"] for r in res)
    print(f"\ntokens per streamed chunk: {tokens / max(chunks, 1):.2f} ({chunks} chunks with text)")
    print(
        f"throughput: server {tokens / wall:.1f} output tok/s ({args.requests / wall:.2f} req/s, {wall:.2f} s); "
        f"engine alone, all at once: {offline_tokens / offline_s:.1f} tok/s ({offline_s:.2f} s); {ratio}"
    )
    out = args.out or os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "bench", "out"), "serve.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(
            {
                "model": name,
                "device": dev,
                "args": vars(args) | {"rate": str(args.rate), "warmup_requests": warm_n},
                "requests": res,
                "wall_s": wall,
                "output_tokens": tokens,
                "offline": {"seconds": offline_s, "output_tokens": offline_tokens},
                "stub_forward": args.stub_forward,
                "server_means_s": server,
            },
            f,
            indent=1,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-stubbed"]:  # the server process of --stub-forward
        sys.path.insert(0, os.path.join(ROOT, "src"))
        _stub_forward()
        from openk3.cli import main as openk3_main

        raise SystemExit(openk3_main(sys.argv[2:]))
    raise SystemExit(main())
