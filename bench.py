"""Score any OpenAI-compatible endpoint, and append one row per concurrency level to SCOREBOARD.md.

    python bench.py --base-url http://127.0.0.1:8000/v1 --target "spark-spec" --prompts short \\
        --concurrency 1,4,16 --n 32 --max-tokens 128 --ignore-eos --change "draft K=4"

A client only (the official `openai` package): it knows nothing about models. Every request streams, so that the
first text can be timed. Per request: TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), the gaps between text
chunks (inter-token latency; one chunk may carry several tokens), E2E; output tokens come from the usage chunk,
never from counting chunks or characters. Per level: p50 / p90 / p99, output tok/s and requests/s over the level's
wall time, failures, and decode tok/s = sum(tokens - 1) / sum(E2E - TTFT), the single-stream speed to compare
with the loop's in-process tok/s. Acceptance rate (accepted / drafted tokens) and mean acceptance length
(1 + accepted / drafts: tokens per target step) come from the server's /metrics deltas when it exports vLLM-style
spec-decode counters (spark-spec and vLLM do; hosted APIs do not, and the row then says —).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import openai

from spec import log
from spec.io import RESULTS_DIR, cell, load_prompts, save_json, table

SCOREBOARD = Path("SCOREBOARD.md")
SCOREBOARD_HEAD = """# Scoreboard

Rows are appended by `bench.py` (one per concurrency level); raw per-request timings are in `results/bench-*.json`.
docs/serving.md gives the commands that produced each set of rows.
Every request streams a chat completion; the note says the workload (prompt set × requests, max tokens, ignore_eos,
temperature when not 0) and what changed.

- **TTFT** (time to first token): from sending the request to receiving the first streamed chunk that carries
  generated text. Role-only chunks do not count; queueing and prefill do. Measured at the client.
- **TPOT** (time per output token): (E2E - TTFT) / (output tokens - 1), per request; output tokens from `usage`.
- **tok/s**: output tokens of all successful requests / wall time of the level. **req/s** likewise.
- **accept**: accepted / drafted tokens; **len**: mean acceptance length = 1 + accepted / drafts (tokens per target
  step), both from the server's `/metrics` deltas over the level; — when the server exports none.
- **fail**: requests that errored (including 429s). Hardware is the serving machine.

"""
SCOREBOARD_COLUMNS = ("date", "target", "hardware", "model", "precision", "method", "K", "conc", "TTFT p50 ms",
                      "TTFT p99 ms", "TPOT p50 ms", "tok/s", "req/s", "accept", "len", "fail", "change")
SCOREBOARD_HEAD += "| " + " | ".join(SCOREBOARD_COLUMNS) + " |\n" + "|---" * len(SCOREBOARD_COLUMNS) + "|\n"

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def json_bias(text: str) -> dict[str, float]:
    try:
        bias = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"--logit-bias must be a JSON object, got {text!r} ({err})") from None
    if not isinstance(bias, dict):
        raise argparse.ArgumentTypeError(f"--logit-bias must be a JSON object of token id -> bias, got {text!r}")
    return {str(key): float(value) for key, value in bias.items()}


def parse_counters(text: str) -> dict[str, float] | None:
    """Spec-decode counters from Prometheus text, summed over label sets and matched by the name after the prefix
    (spark:..., vllm:...); None unless all three are there."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0].split(":")[-1].removesuffix("_total")
        if base in SPEC_COUNTERS:
            try:
                totals[base] = totals.get(base, 0.0) + float(value)
            except ValueError:
                continue
    return totals if set(totals) == set(SPEC_COUNTERS) else None


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The server's spec-decode counters now, or None where it has no /metrics (hosted APIs)."""
    try:
        response = await client.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return parse_counters(response.text) if response.status_code == 200 else None


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, args) -> dict:
    """Stream one chat completion; return its timings (seconds) or its error."""
    start = time.perf_counter()
    row = {"start": start, "ok": False}
    chunks, tokens = [], None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True}, **sampling_fields(args))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.APIError as err:
        row["error"] = f"{type(err).__name__}: {getattr(err, 'status_code', '')} {err.message}".strip()
        return row
    end = time.perf_counter()
    if tokens is None or not chunks:
        row["error"] = "no usage chunk" if tokens is None else "no text"
        return row
    ttft, e2e = chunks[0] - start, end - start
    gaps = np.diff(chunks).tolist()
    row.update(ok=True, ttft=ttft, e2e=e2e, tokens=tokens, chunks=len(chunks), itl=gaps,
               tpot=(e2e - ttft) / (tokens - 1) if tokens > 1 else None)
    return row


# OpenAI fields, sent when set; and extensions (vLLM's and spark-spec's), sent in the body when set.
OPENAI_FIELDS = ("top_p", "presence_penalty", "frequency_penalty", "seed", "logit_bias")
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "coupled", "ignore_eos")


def sampling_fields(args) -> dict:
    """The request's sampling parameters beyond temperature, as the openai client takes them."""
    fields = {name: getattr(args, name) for name in OPENAI_FIELDS if getattr(args, name) is not None}
    extra = {name: getattr(args, name) for name in EXTENSIONS if getattr(args, name) not in (None, False)}
    return {**fields, **({"extra_body": extra} if extra else {})}


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(rows: list[dict], wall: float, before: dict | None, after: dict | None) -> dict:
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [gap for r in ok for gap in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    out = {"requests": len(rows), "failures": len(rows) - len(ok), "wall_s": wall,
           "output_tokens": sum(r["tokens"] for r in ok),
           "tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else None,
           "req_s": len(ok) / wall if wall > 0 else None, "acceptance": None, "acceptance_length": None}
    # Single-stream decode speed, comparable with the loop's in-process tok/s: tokens after the first / time after it.
    after_first = sum(r["e2e"] - r["ttft"] for r in ok if r["tokens"] > 1)
    out["decode_tok_s"] = sum(r["tokens"] - 1 for r in ok if r["tokens"] > 1) / after_first if after_first else None
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = pct(values, q)
    if before and after:
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        if drafted > 0 and drafts > 0:
            out["acceptance"] = accepted / drafted
            out["acceptance_length"] = 1 + accepted / drafts
    return out


async def run_level(client, metrics_client, metrics_url, model, prompts, concurrency, args, bar) -> dict:
    """n requests, `concurrency` in flight at a time, prompts taken in order (cycling)."""
    before = await scrape(metrics_client, metrics_url)
    pending = list(range(args.n))
    rows: list[dict] = []

    async def worker():
        while pending:
            i = pending.pop(0)
            row = await one_request(client, model, prompts[i % len(prompts)]["prompt"], args)
            rows.append({"index": i, "prompt_id": prompts[i % len(prompts)]["id"], **row})
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = await scrape(metrics_client, metrics_url)
    rows.sort(key=lambda r: r["index"])
    return {"concurrency": concurrency, "summary": summarise(rows, wall, before, after), "requests": rows}


def scoreboard_row(level: dict, labels: dict) -> str:
    s = level["summary"]

    def ms(seconds: float | None) -> str:
        return cell(None if seconds is None else seconds * 1000, ".0f")

    cells = [labels["date"], labels["target"], labels["hardware"], labels["model"], labels["precision"],
             labels["method"], labels["k"], str(level["concurrency"]), ms(s["ttft_p50"]), ms(s["ttft_p99"]),
             cell(None if s["tpot_p50"] is None else s["tpot_p50"] * 1000, ".1f"), cell(s["tok_s"], ".2f"),
             cell(s["req_s"], ".3f"), cell(s["acceptance"], ".2f"), cell(s["acceptance_length"], ".2f"),
             str(s["failures"]), labels["change"]]
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n"


def append_rows(path: Path, rows: list[str]) -> None:
    if not path.exists() or not path.read_text().strip():
        path.write_text(SCOREBOARD_HEAD)
    with open(path, "a") as f:
        f.writelines(rows)


async def served_model(client: openai.AsyncOpenAI, wanted: str | None) -> tuple[str, dict]:
    """The model to ask for (the first served one unless named) and the server's own description of it."""
    try:
        cards = (await client.models.list()).data
    except openai.APIConnectionError:
        raise SystemExit(f"error: no server answers at {client.base_url}") from None
    except openai.APIError as err:
        raise SystemExit(f"error: cannot list models at {client.base_url}: {err.message}") from None
    if wanted:
        card = next((c for c in cards if c.id == wanted), None)
        if card is None:
            raise SystemExit(f"error: {wanted!r} is not served at {client.base_url} (served: "
                             f"{', '.join(c.id for c in cards) or 'none'})")
    elif cards:
        card = cards[0]
    else:
        raise SystemExit(f"error: {client.base_url} serves no models; pass --model")
    return card.id, (card.model_extra or {}).get("speculation") or {}


def precision(served: dict) -> str:
    """The server's dtype, and its weight formats where they are not the dtype's: a quantized target is another
    model, so its row must say so."""
    parts = [served.get("dtype", "—")]
    parts += [f"{served[key]} {role}" for key, role in (("target_quant", "target"), ("draft_quant", "draft"))
              if served.get(key, "none") != "none"]
    return ", ".join(parts)


def conditions(args) -> str:
    """The row's note: the workload, then the user's change note."""
    parts = [f"{Path(args.prompts).stem} ×{args.n}", f"max {args.max_tokens} tok"]
    if args.ignore_eos:
        parts.append("ignore_eos")
    if args.temperature:
        parts.append(f"T={args.temperature:g}")
    sent = sampling_fields(args)
    parts += [f"{name}={value}" for name, value in {**sent.pop("extra_body", {}), **sent}.items()
              if name != "ignore_eos"]
    return "; ".join(parts + ([args.change] if args.change else []))


def default_hardware() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.machine()})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark an OpenAI-compatible endpoint (TTFT, TPOT, tok/s, acceptance) and append one "
                    "SCOREBOARD.md row per concurrency level. Warm-up first; raw per-request JSON in results/.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the endpoint, ending in /v1")
    parser.add_argument("--api-key", default="none", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--model", help="model name to request (default: the first the server lists)")
    parser.add_argument("--target", default="spark-spec", help="label of the serving stack for the row (e.g. vllm)")
    parser.add_argument("--hardware", default=None, help="label of the serving machine (default: this machine's "
                                                         "CPU count, which is right only for a local server)")
    parser.add_argument("--precision", help="label, e.g. bf16 (default: what the server reports, else —)")
    parser.add_argument("--method", help="label: draft, lookup, ngram, none… (default: what the server reports)")
    parser.add_argument("--k", help="label: drafts per round (default: what the server reports)")
    parser.add_argument("--prompts", default="short", help="prompt set in prompts/ (short, code, rename) or a "
                                                          ".jsonl path")
    parser.add_argument("--concurrency", default=[1, 4, 16], type=parse_levels, help="levels, e.g. 1,4,16")
    parser.add_argument("--n", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate all max_tokens (vLLM / spark-spec extension)")
    g = parser.add_argument_group("sampling (sent only when given; the extensions in the request body)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--logit-bias", type=json_bias, help='a JSON object of token id -> bias, e.g. \'{"100": -100}\'')
    g.add_argument("--top-k", type=int, help="extension (vLLM, spark-spec)")
    g.add_argument("--min-p", type=float, help="extension (vLLM, spark-spec)")
    g.add_argument("--repetition-penalty", type=float, help="extension (vLLM, spark-spec)")
    g.add_argument("--coupled", action="store_true", help="spark-spec's coupled sampling (with --seed)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the first level")
    parser.add_argument("--change", default="", help="what changed, for the row's note")
    parser.add_argument("--scoreboard", type=Path, default=SCOREBOARD, help="markdown file rows are appended to")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the raw JSON")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.n < 1 or args.max_tokens < 1 or args.warmup < 0 or args.timeout <= 0:
        parser.error("--n and --max-tokens must be >= 1, --warmup >= 0, --timeout > 0")
    return args


async def bench(args) -> dict:
    prompts = load_prompts(args.prompts)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    # The same key opens /metrics on servers that protect it (spark-spec with --api-key).
    http = httpx.AsyncClient(limits=limits, timeout=args.timeout, headers=headers)
    client = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, http_client=http, max_retries=0)
    metrics_url = args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        model, served = await served_model(client, args.model)
        labels = {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"), "target": args.target,
            "hardware": args.hardware or default_hardware(), "model": model,
            "precision": args.precision or precision(served), "method": args.method or served.get("method", "—"),
            "k": args.k or served.get("k", "—"), "change": conditions(args),
        }
        for i in range(args.warmup):
            await one_request(client, model, prompts[i % len(prompts)]["prompt"], args)
        levels = []
        with log.bar(total=args.n * len(args.concurrency), desc="bench", unit="req") as bar:
            for concurrency in args.concurrency:
                bar.set_postfix(concurrency=concurrency)
                levels.append(await run_level(client, http, metrics_url, model, prompts, concurrency, args, bar))
    finally:
        await http.aclose()
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()
              if key != "api_key"}
    return {"labels": labels, "config": config, "served": served, "levels": levels}


def main(argv=None) -> int:
    args = parse_args(argv)
    log.QUIET = args.quiet
    data = asyncio.run(bench(args))
    path = save_json("bench", data, args.out)
    append_rows(args.scoreboard, [scoreboard_row(level, data["labels"]) for level in data["levels"]])
    rows = [{"concurrency": level["concurrency"], **level["summary"]} for level in data["levels"]]
    for row in rows:
        for key in ("ttft_p50", "ttft_p99", "tpot_p50", "itl_p50", "e2e_p50"):
            row[key] = None if row[key] is None else row[key] * 1000
    print(table(rows, [("concurrency", "d"), ("requests", "d"), ("failures", "d"), ("ttft_p50", ".0f"),
                       ("ttft_p99", ".0f"), ("tpot_p50", ".1f"), ("itl_p50", ".1f"), ("e2e_p50", ".0f"),
                       ("tok_s", ".2f"), ("decode_tok_s", ".2f"), ("req_s", ".3f"), ("acceptance", ".2f"),
                       ("acceptance_length", ".2f")]))
    print(f"times in ms; rows appended to {args.scoreboard}; raw JSON {path}", file=sys.stderr)
    return 1 if any(level["summary"]["failures"] for level in data["levels"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
