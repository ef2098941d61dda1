"""Load a running server_spec.py and check that nothing it accepted is lost or mangled.

    python server_spec.py --pair tiny --queue 4 --port 8000 &
    python scripts/load_test.py --base-url http://127.0.0.1:8000 --clients 16 --rounds 4 --disconnect 0.25

Each round, `--clients` streaming greedy completions start at once; a seeded random fraction of them hang up
after their first text. Every request must end in exactly one of three ways: complete and well-formed (role/text
chunks, one finish_reason, usage, then [DONE]; text equal to the non-streamed greedy answer of the same prompt),
429 in the OpenAI envelope (queue full), or a deliberate hang-up. Meanwhile /health is polled and must stay 200.
After each round the worker must be idle within a few seconds (no generation left running for departed clients);
the server's resident memory is read from /metrics after every round. Prints a summary and exits 1 on any failure;
`--json PATH` writes the full report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx


def metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


def prompts(count: int) -> list[str]:
    return [f"Request {i}: count to ten." for i in range(count)]


async def streamed(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, hang_up: bool) -> dict:
    """One streaming request; returns its outcome: complete (with text), rejected (429), hung_up, or failed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                error = json.loads(await response.aread()).get("error", {})
                ok = set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_full"
                return {"outcome": "rejected" if ok else "failed", "why": f"429 without the envelope: {error}"}
            if response.status_code != 200:
                return {"outcome": "failed", "why": f"status {response.status_code}: {await response.aread()!r}"}
            events = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if hang_up and data != "[DONE]" and events[-1].get("choices") and events[-1]["choices"][0]["text"]:
                    return {"outcome": "hung_up"}
    except httpx.HTTPError as err:
        return {"outcome": "failed", "why": f"{type(err).__name__}: {err}"}
    return check_stream(events)


def check_stream(events: list) -> dict:
    """A complete stream: text chunks, exactly one finish_reason, the usage chunk, then [DONE] and nothing else."""
    if not events or events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
        return {"outcome": "failed", "why": "the stream did not end with exactly one [DONE]"}
    chunks = events[:-1]
    if any("error" in c for c in chunks):
        return {"outcome": "failed", "why": f"error chunk: {next(c for c in chunks if 'error' in c)}"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    if len(finishes) != 1 or len(usage) != 1 or chunks[-1]["choices"]:
        return {"outcome": "failed", "why": f"finish reasons {finishes}, {len(usage)} usage chunks"}
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return {"outcome": "complete", "text": text, "tokens": usage[0]["completion_tokens"]}


async def watch_health(base_url: str, stop: asyncio.Event, bad: list) -> int:
    """Poll /health every 0.2 s until `stop`; record every answer that is not 200."""
    polls = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            try:
                status = (await client.get("/health")).status_code
            except httpx.HTTPError as err:
                status = f"{type(err).__name__}"
            polls += 1
            if status != 200:
                bad.append(status)
            await asyncio.sleep(0.2)
    return polls


async def one_round(args, headers: dict, model: str, expected: dict[str, str], rng: random.Random) -> list[dict]:
    plan = [(prompt, rng.random() < args.disconnect) for prompt in rng.choices(list(expected), k=args.clients)]
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        results = await asyncio.gather(*(streamed(client, model, p, args.max_tokens, h) for p, h in plan))
    for (prompt, _), result in zip(plan, results):
        result["prompt"] = prompt
        if result["outcome"] == "complete" and result["text"] != expected[prompt]:
            result.update(outcome="failed", why="streamed text differs from the non-streamed greedy answer")
    return results


def idle_within(client: httpx.Client, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        m = metrics(client)
        if m["spark:num_requests_running"] == 0 and m["spark:num_requests_waiting"] == 0:
            return True
        time.sleep(0.1)
    return False


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=args.timeout) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        expected = {}
        for prompt in prompts(args.prompts):  # the reference: each prompt once, non-streamed, one at a time
            answer = client.post("/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0,
                                                         "max_tokens": args.max_tokens})
            answer.raise_for_status()
            expected[prompt] = answer.json()["choices"][0]["text"]
        start = metrics(client)
        stop, bad_health = asyncio.Event(), []
        health = asyncio.create_task(watch_health(args.base_url, stop, bad_health))
        rounds = []
        for number in range(args.rounds):
            results = await one_round(args, headers, model, expected, rng)
            idle = idle_within(client, args.idle_seconds)
            rounds.append({"round": number, "rss": metrics(client)["process_resident_memory_bytes"], "idle": idle,
                           "outcomes": {k: sum(r["outcome"] == k for r in results)
                                        for k in ("complete", "rejected", "hung_up", "failed")},
                           "failures": [r for r in results if r["outcome"] == "failed"]})
        stop.set()
        polls = await health
        end = metrics(client)
    totals = {k: sum(r["outcomes"][k] for r in rounds) for k in ("complete", "rejected", "hung_up", "failed")}
    counters = {name: end.get(name, 0) - start.get(name, 0)
                for name in ("spark:request_cancelled_total", "spark:request_rejected_total{reason=\"queue_full\"}")}
    return {"config": {k: v for k, v in vars(args).items() if k != "api_key"}, "rounds": rounds, "totals": totals,
            "health_polls": polls, "health_not_200": bad_health, "server_counters": counters,
            "rss_first_round": rounds[0]["rss"], "rss_last_round": rounds[-1]["rss"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    parser.add_argument("--api-key")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming requests per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--disconnect", type=float, default=0.25, help="fraction of clients that hang up early")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seeds who hangs up and which prompt each sends")
    parser.add_argument("--idle-seconds", type=float, default=10, help="how soon the worker must be idle after "
                                                                       "a round")
    parser.add_argument("--max-rss-growth", type=float, default=64e6,
                        help="bytes the server's memory may grow from the first round to the last")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", help="write the full report here")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.rounds < 1 or args.prompts < 1 or not 0 <= args.disconnect <= 1:
        parser.error("--clients, --rounds and --prompts must be >= 1 and --disconnect within [0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    growth = report["rss_last_round"] - report["rss_first_round"]
    problems = [f"{report['totals']['failed']} failed requests"] if report["totals"]["failed"] else []
    problems += [f"/health answered {report['health_not_200'][:5]}"] if report["health_not_200"] else []
    problems += [f"worker still busy {args.idle_seconds:g} s after round {r['round']}"
                 for r in report["rounds"] if not r["idle"]]
    problems += [f"memory grew {growth / 1e6:.1f} MB"] if growth > args.max_rss_growth else []
    report["problems"] = problems
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    t = report["totals"]
    print(f"{args.rounds} rounds × {args.clients} clients: {t['complete']} complete, {t['rejected']} rejected "
          f"(429), {t['hung_up']} hung up, {t['failed']} failed; /health polled {report['health_polls']}×; "
          f"server RSS {report['rss_first_round'] / 1e6:.1f} MB after round 1, "
          f"{report['rss_last_round'] / 1e6:.1f} MB after round {args.rounds}")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    for r in report["rounds"]:
        for failure in r["failures"][:3]:
            print(f"  round {r['round']}: {failure['why']}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
