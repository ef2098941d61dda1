"""How long until a pair is ready to decode, with cold and with warm compile caches, and the server's first request.

    python -m spec.start_time --pair qwen-coder --device cuda            # in-process start, cold then warm
    python -m spec.start_time --pair llama-random --device cuda --server # also server_spec.py's first request

Each measurement is a fresh process, so that nothing is cached in memory. "cold" points Triton's and Inductor's
compile caches at a new empty folder; "warm" runs again over the same folder. A start is split into: importing
torch and transformers, loading the pair (weights from the user cache), and preparing it (the graph backend compiles
its kernels and captures its CUDA graphs for texts of up to --context tokens) plus a first short generation: the
point at which a task or the server is ready. With --server the same is timed from launch to GET /health = 200,
then one streamed chat completion (time to first text and end to end). Writes results/start_time-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from spec.cli import add_model_args, load_from_args
from spec.drafters import ModelDrafter
from spec.io import Results, table
from spec.loop import generate
from spec.models import sync_time

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> dict:
    """The measurement inside the fresh process the parent launched at `args.launched_at` (wall-clock seconds):
    the interpreter's start and the imports, loading, preparing; one JSON object."""
    imported = time.time()
    pair = load_from_args(args)
    sync_time(pair.device)
    loaded = time.time()
    pair.prepare(args.k, args.context)
    prompt = pair.tokenizer("Hello").input_ids or [0]
    generate(pair.target, ModelDrafter(pair.draft), prompt, 8, k=args.k, eos=())
    sync_time(pair.device)
    ready = time.time()
    return {"import_s": imported - args.launched_at, "load_s": loaded - imported, "prepare_s": ready - loaded,
            "ready_s": ready - args.launched_at, **pair.setup_fields(), "device": str(pair.device)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_start(args, env: dict) -> dict:
    """Launch server_spec.py; seconds to GET /health = 200, then one streamed chat completion."""
    port = free_port()
    command = [sys.executable, str(ROOT / "server_spec.py"), "--pair", args.pair, "--k", str(args.k), "--port",
               str(port), "--backend", args.backend, "--quiet", *(["--device", args.device] if args.device else [])]
    start = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"error: the server exited: {server.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready = time.perf_counter() - start
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Write a haiku about caches."}],
                "max_tokens": 32, "temperature": 0, "stream": True}
        sent = time.perf_counter()
        first = None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                text = line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line
                if first is None and text:
                    first = time.perf_counter() - sent
        return {"server_ready_s": ready, "first_request_ttft_s": first,
                "first_request_e2e_s": time.perf_counter() - sent}
    finally:
        server.terminate()
        server.wait(30)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m spec.start_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--k", type=int, default=4, help="drafts per round to prepare for (default 4)")
    parser.add_argument("--context", type=int, default=1024, help="text length to prepare for (default 1024)")
    parser.add_argument("--server", action="store_true",
                        help="also time server_spec.py from launch to its first answer")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    results = Results("start_time")
    caches = Path(tempfile.mkdtemp(prefix="spark-spec-start-"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--server"]
    rows = []
    for cache in ("cold", "warm"):
        command = [sys.executable, "-m", "spec.start_time", *passed, "--child", "--quiet",
                   "--launched-at", repr(time.time())]
        run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"error: the {cache} start failed:\n{run.stderr[-3000:]}")
        rows.append(results.add({"cache": cache, "what": "in-process", **json.loads(run.stdout.splitlines()[-1])}))
    if args.server:
        for cache in ("cold", "warm"):  # a new empty cache folder for the server's cold start
            if cache == "cold":
                caches = Path(tempfile.mkdtemp(prefix="spark-spec-start-"))
                env.update(TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
            rows.append(results.add({"cache": cache, "what": "server", **server_start(args, env)}))
    print(table(rows, [("what", "s"), ("cache", "s"), ("import_s", ".1f"), ("load_s", ".1f"), ("prepare_s", ".1f"),
                       ("ready_s", ".1f"), ("server_ready_s", ".1f"), ("first_request_ttft_s", ".3f"),
                       ("first_request_e2e_s", ".3f")]))
    ran = {key: rows[0][key] for key in ("backend", "draft_backend") if key in rows[0]}  # what --backend picked
    path = results.finish({"task": "start_time", "pair": args.pair, "backend_asked": args.backend, **ran,
                           "k": args.k, "context": args.context})
    print(f"saved {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
