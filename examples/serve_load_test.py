"""Load test for `pitools serve`: concurrent OpenAI-protocol clients, latency percentiles and throughput.

    pitools serve MODEL --port 8080 &
    python examples/serve_load_test.py --url http://127.0.0.1:8080 --clients 32 --requests 320 --out report.json

``--clients`` clients share ``--requests`` requests; each sends its next one as soon as its last is
answered. A ``--chat-share`` of the requests go to /v1/chat/completions, the rest to /v1/completions, a
``--stream-share`` of them streamed, each with its own prompt: a slice of the model folder's held-out text (the bundled
model's by default), never the same text twice, so nothing is easier for being repeated. A 503 (queue
full) is retried after its Retry-After, as a client should, and counted; anything else that is not a
complete answer (an error status, a stream without ``[DONE]``, a broken connection) is a failure.

Prints and writes (``--out``) the failures, latency percentiles (whole request; first token of streams),
requests/s and tokens/s, and the server's own /metrics counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from powerinfer_tools.bundled import BUNDLED_MODEL


def prompts(text: str, count: int, words: int, seed: int) -> list[str]:
    """``count`` different slices of ``words`` words of ``text``, spread over it."""
    tokens = text.split()
    step = max(1, (len(tokens) - words) // max(count, 1))
    start = seed % step
    return [" ".join(tokens[start + i * step: start + i * step + words]) for i in range(count)]


def picked(i: int, share: float) -> bool:
    """Whether request ``i`` is among a ``share`` of them, spread evenly over the run."""
    return int((i + 1) * share) > int(i * share)


def request_body(i: int, prompt: str, args) -> tuple[str, dict]:
    body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": i,
            "stream": picked(i, args.stream_share)}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if picked(i * 7 + 3, args.chat_share):  # spread over the run, not in step with streaming
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, route: str, body: dict) -> dict:
    """Sends until answered (retrying 503s); the outcome: ok, seconds, first-token seconds, tokens, retries."""
    retries = 0
    while True:
        start = time.perf_counter()
        if body["stream"]:
            outcome = await streamed(client, route, body, start)
        else:
            response = await client.post(route, json=body)
            outcome = {"status": response.status_code, "seconds": time.perf_counter() - start}
            if response.status_code == 200:
                outcome["tokens"] = response.json()["usage"]["completion_tokens"]
            else:
                outcome["retry_after"] = response.headers.get("retry-after")
        if outcome["status"] != 503:
            return {**outcome, "retries": retries, "ok": outcome["status"] == 200 and "tokens" in outcome}
        retries += 1
        await asyncio.sleep(float(outcome.get("retry_after") or 1))


async def streamed(client: httpx.AsyncClient, route: str, body: dict, start: float) -> dict:
    async with client.stream("POST", route, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "retry_after": response.headers.get("retry-after"),
                    "seconds": time.perf_counter() - start}
        first, usage, chunks, done = None, None, 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                break
            texts = [c.get("text") or c.get("delta", {}).get("content") for c in chunk["choices"]]
            chunks += any(t is not None for t in texts)
            if first is None and any(texts):
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
        outcome = {"status": 200 if done else 599, "seconds": time.perf_counter() - start, "first_token": first}
        if done:  # a server that sends no usage chunk: one chunk a token, as llama.cpp's streams
            outcome["tokens"] = usage["completion_tokens"] if usage else chunks
        return outcome


async def load(args) -> dict:
    texts = prompts((args.model_folder / "heldout.txt").read_text(encoding="utf-8"), args.requests, args.words,
                    args.seed)
    queue: asyncio.Queue = asyncio.Queue()
    for i, prompt in enumerate(texts):
        queue.put_nowait((i, prompt))
    outcomes: list[dict] = []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits) as client:

        async def client_loop():
            while not queue.empty():
                i, prompt = queue.get_nowait()
                route, body = request_body(i, prompt, args)
                try:
                    outcomes.append(await one_request(client, route, body))
                except httpx.HTTPError as exc:
                    outcomes.append({"ok": False, "status": type(exc).__name__, "retries": 0})

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(args.clients)))
        wall = time.perf_counter() - start
        metrics = (await client.get("/metrics")).text
    return summarize(outcomes, wall, metrics, args)


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def summarize(outcomes: list[dict], wall: float, metrics: str, args) -> dict:
    ok = [o for o in outcomes if o["ok"]]
    seconds = [o["seconds"] for o in ok]
    first = [o["first_token"] for o in ok if o.get("first_token") is not None]
    tokens = sum(o["tokens"] for o in ok)
    server = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("pitools_") and "{" not in line}
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"},
        "requests": len(outcomes), "succeeded": len(ok), "failed": len(outcomes) - len(ok),
        "failures": sorted({str(o["status"]) for o in outcomes if not o["ok"]}),
        "retried_503": sum(o["retries"] for o in outcomes),
        "wall_seconds": wall, "requests_per_second": len(ok) / wall, "completion_tokens_per_second": tokens / wall,
        "latency_seconds": {f"p{p}": percentile(seconds, p) for p in (50, 90, 99)} | {"mean": statistics.fmean(seconds) if seconds else None},
        "first_token_seconds": {f"p{p}": percentile(first, p) for p in (50, 90, 99)},
        # How much of the wall time the model computed; the rest is HTTP, JSON, tokenizing and queueing.
        "model_busy_share": (server.get("pitools_prompt_seconds_total", 0) +
                             server.get("pitools_generation_seconds_total", 0)) / wall,
        "server_metrics": server,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="tiny-relu-llama", help="The id the server serves (GET /v1/models).")
    parser.add_argument("--model-folder", type=Path, default=BUNDLED_MODEL, help="Where heldout.txt is read.")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--words", type=int, default=24, help="Words of held-out text per prompt.")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--stream-share", type=float, default=0.5, help="Share of requests streamed.")
    parser.add_argument("--chat-share", type=float, default=0.5,
                        help="Share of requests to /v1/chat/completions (0: completions only, for a server whose "
                             "model has no chat template).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds a request may take in all.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", type=Path, default=None, help="Write the report here (JSON).")
    args = parser.parse_args(argv)
    report = asyncio.run(load(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
