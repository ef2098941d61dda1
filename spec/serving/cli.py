"""The server's command line: `python server_spec.py --help`."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from spec import log
from spec.cli import add_model_args, add_tree_arg, load_from_args, resolve_tree
from spec.models import DEFAULT_MAX_LENGTH, resolve_pair
from spec.policy import parse_k
from spec.serving.app import create_app
from spec.serving.engine import Engine

PREPARE_CONTEXT = 2048  # texts this long are ready at start; longer ones capture their graphs on first use
# (a --max-model-len is prepared for up to DEFAULT_MAX_LENGTH: every 256 positions more cost a set of captures)


class Server(uvicorn.Server):
    """uvicorn's server, draining the engine when SIGTERM/SIGINT arrives (before uvicorn stops listening)."""

    def __init__(self, config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain(self.grace)
        super().handle_exit(sig, frame)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="OpenAI-compatible server over spark-spec's speculative loop (exact: the same answers as the "
                    "target alone). Binds to loopback by default.")
    add_model_args(parser)
    g = parser.add_argument_group("speculation")
    g.add_argument("--method", default="draft", choices=["draft", "lookup", "none"],
                   help="where drafts come from: the draft model, prompt lookup, or none (plain decoding)")
    g.add_argument("--k", default=4, type=parse_k, help="drafts per round: an integer, or auto / auto:MAX "
                   "(adaptive K, chosen each round from measured acceptance and costs)")
    add_tree_arg(g)
    g.add_argument("--first-token", default="alone", choices=["alone", "with-round"],
                   help="alone (default): a request's first token is streamed after the target's prefill and one "
                        "step, as with plain decoding, and the draft reads the prompt after it; with-round: the "
                        "first token comes with the first round's accepted drafts (one target step less a "
                        "request, a later first token). Greedy output is the same either way, and sampling keeps "
                        "the target's law (a seed gives another text in each)")
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000)
    keys = g.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    keys.add_argument("--api-key-file", help="the same, with the key read from a file (command lines are visible "
                                             "to every local user; files can be private)")
    g.add_argument("--served-model-name", help="the model name clients send (default: the pair's name)")
    g.add_argument("--queue", type=int, default=16, help="requests that may wait for the worker; more get 429")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, waiting included, before it fails with 504")
    g.add_argument("--max-model-len", type=int, help="tokens a request may use, prompt + max_tokens, and what the "
                   "graph backend's KV cache holds (default: the model's context; on CUDA the graph backend's static "
                   f"cache, allocated whole, holds {DEFAULT_MAX_LENGTH:,} positions unless this says more)")
    g.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (413 above)")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long the running request may continue before it is aborted")
    args = parser.parse_args(argv)
    if min(args.queue, args.max_body, args.max_model_len or 2) < 1 or args.request_timeout <= 0:
        parser.error("--queue, --request-timeout, --max-body and --max-model-len must be positive")
    resolve_tree(parser, args, args.method)
    if args.drain_seconds < 0:
        parser.error("--drain-seconds must be >= 0")
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                args.api_key = f.read().strip()
        except OSError as err:
            parser.error(f"cannot read --api-key-file: {err.strerror}")
        if not args.api_key:
            parser.error(f"--api-key-file {args.api_key_file} is empty")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log.QUIET = args.quiet
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    engine = Engine(args.method, args.k, args.queue, args.request_timeout, args.tree,
                    first_alone=args.first_token == "alone")
    model_name = args.served_model_name or args.target or resolve_pair(args.pair)[0]
    failed = []

    def load():
        pair = load_from_args(args, with_draft=args.method == "draft")
        engine.prepare(pair, min(args.max_model_len or PREPARE_CONTEXT, DEFAULT_MAX_LENGTH))
        log.info(f"ready: serving {model_name!r} on http://{args.host}:{args.port} "
                 f"(method {args.method}, K {args.k if isinstance(args.k, int) else 'auto'}"
                 + (f"; {pair.target_quant} TARGET weights, a changed model" if pair.target_quant != "none" else "")
                 + ")")
        return pair

    def load_failed(err: BaseException) -> None:
        failed.append(err)
        print(getattr(err, "code", err), file=sys.stderr, flush=True)
        server.should_exit = True

    app = create_app(engine, model_name, args.api_key, args.max_body, args.max_model_len, load=load,
                     on_load_error=load_failed)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                            timeout_graceful_shutdown=args.drain_seconds + 5)
    server = Server(config, engine, args.drain_seconds)
    server.run()
    return 1 if failed else 0
