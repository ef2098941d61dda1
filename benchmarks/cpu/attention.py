"""Attention implementations side by side on the CPU, one process: transformers' `sdpa` (PyTorch's fused kernel, its
default) and `eager` (matmul-softmax-matmul, K/V repeated per query head), and ours (spec/models/attention.py: query
heads grouped over their K/V head, scores in fp32), which the eager backend runs on a CPU.

    python benchmarks/cpu/attention.py --pair qwen-coder --quant int4 --contexts 40,250,1200 --tokens 1,2,4
    python benchmarks/cpu/attention.py --parts decode --prompts rename --limit 3 --max-new-tokens 48

`forwards`: forwards of a few tokens on cached texts of several lengths, the implementations switched in turn on the
same loaded model, round after round. `prefill`: one forward over a whole prompt of each length in --prefills.
`decode`: plain and speculative greedy decoding of the prompts (the draft in --draft-quant, K = --k) with each
implementation on both models in turn, prompt by prompt; whether each run's speculative text equals its plain text,
and whether the implementations wrote the same text. Rows go to results/attention-<time>.jsonl as they come.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.harness import forward_times, run_loop, timed  # noqa: E402
from spec.io import Results, load_prompts, table  # noqa: E402
from spec.models import load_pair  # noqa: E402
from spec.models.attention import NAME  # noqa: E402
from spec.models.eager import EagerModel  # noqa: E402
from spec.models.pairs import PAIRS, load_model, resolve_pair  # noqa: E402
from spec.models.quant import quantize_model  # noqa: E402
from spec.models.tokens import chat_ids  # noqa: E402

IMPLEMENTATIONS = {"sdpa": "sdpa", "eager": "eager", "ours": NAME}
FORWARD_COLUMNS = [("role", ""), ("context", ""), ("tokens", ""), ("sdpa_ms", ".2f"), ("eager_ms", ".2f"),
                   ("ours_ms", ".2f"), ("sdpa_over_ours", ".2f")]
DECODE_COLUMNS = [("id", ""), ("prompt_tokens", ""), ("attention", ""), ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"),
                  ("speedup", ".2f"), ("identical", ""), ("same_text_as_sdpa", "")]


def forwards(args, results: Results, name: str) -> None:
    for role in args.roles.split(","):
        loaded = load_model(getattr(PAIRS[name], role), torch.device("cpu"), torch.bfloat16, role=role)
        if args.quant != "none":
            quantize_model(loaded.model, args.quant, what=role)
        model = EagerModel(loaded.model)
        for context in map(int, args.contexts.split(",")):
            cached = list(range(1000, 1000 + context))
            for n in map(int, args.tokens.split(",")):
                times = {impl: [] for impl in IMPLEMENTATIONS}
                for _ in range(args.rounds):
                    for impl, attention in IMPLEMENTATIONS.items():
                        loaded.model.set_attn_implementation(attention)
                        times[impl] += forward_times(model, cached, [5] * n, trials=args.trials)
                ms = {f"{impl}_ms": statistics.median(t) * 1e3 for impl, t in times.items()}
                row = results.add({"part": "forwards", "role": role, "quant": args.quant, "context": context,
                                   "tokens": n, **ms, "sdpa_over_ours": ms["sdpa_ms"] / ms["ours_ms"]})
                print(table([row], FORWARD_COLUMNS), flush=True)
        for prompt in map(int, args.prefills.split(",")) if args.prefills else ():
            ids = list(range(1000, 1000 + prompt))
            seconds = {impl: [] for impl in IMPLEMENTATIONS}
            for _ in range(args.rounds):
                for impl, attention in IMPLEMENTATIONS.items():
                    loaded.model.set_attn_implementation(attention)
                    model.reset()
                    start = time.perf_counter()
                    model.forward(ids, keep=1)
                    seconds[impl].append(time.perf_counter() - start)
            ms = {f"{impl}_ms": min(s) * 1e3 for impl, s in seconds.items()}
            row = results.add({"part": "prefill", "role": role, "quant": args.quant, "context": 0, "tokens": prompt,
                               **ms, "sdpa_over_ours": ms["sdpa_ms"] / ms["ours_ms"]})
            print(table([row], FORWARD_COLUMNS), flush=True)
        model.reset()


def decode(args, results: Results, name: str) -> None:
    pair = load_pair(name, device="cpu", draft_quant=args.draft_quant)
    tokens = args.max_new_tokens
    for prompt in load_prompts(args.prompts)[: args.limit]:
        ids = chat_ids(pair.tokenizer, prompt["prompt"])
        texts = {}
        for _ in range(args.rounds):
            for impl in ("sdpa", "ours"):
                for model in (pair.target.model, pair.draft.model):
                    model.set_attn_implementation(IMPLEMENTATIONS[impl])
                plain, plain_s = timed(lambda ids=ids: run_loop(pair, "none", 0, ids, tokens), pair.device)
                spec, spec_s = timed(lambda ids=ids: run_loop(pair, "draft", args.k, ids, tokens), pair.device)
                texts.setdefault(impl, plain.tokens)
                row = results.add({
                    "part": "decode", "id": prompt["id"], "prompt_tokens": len(ids), "attention": impl,
                    "plain_tok_s": len(plain.tokens) / plain_s, "spec_tok_s": len(spec.tokens) / spec_s,
                    "plain_decode_tok_s": plain.tok_s, "spec_decode_tok_s": spec.tok_s,
                    "alpha": spec.alpha, "speedup": plain_s / spec_s * len(spec.tokens) / len(plain.tokens),
                    "identical": spec.tokens == plain.tokens, "same_text_as_sdpa": plain.tokens == texts["sdpa"]})
                print(table([row], DECODE_COLUMNS), flush=True)
    for model in (pair.target.model, pair.draft.model):
        model.set_attn_implementation(NAME)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pair", default="qwen-coder", help="model pair (default qwen-coder)")
    parser.add_argument("--parts", default="forwards,decode", help="forwards and/or decode (default both)")
    parser.add_argument("--roles", default="draft,target", help="forwards: which models (default draft,target)")
    parser.add_argument("--quant", default="int4", choices=["none", "int8", "int4"],
                        help="forwards: weight format of both (default int4, the CPU's fastest)")
    parser.add_argument("--contexts", default="40,250,1200", help="forwards: cached tokens (default 40,250,1200)")
    parser.add_argument("--tokens", default="1,2,4", help="forwards: tokens per forward (default 1,2,4)")
    parser.add_argument("--prefills", default="200,1000", help="forwards: whole-prompt lengths ('' for none)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the implementations in turn (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="forwards per implementation and round (default 5)")
    parser.add_argument("--prompts", default="rename", help="decode: prompt set (default rename: 450-650 tokens)")
    parser.add_argument("--limit", type=int, default=3, help="decode: prompts (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="decode: tokens a run (default 48)")
    parser.add_argument("--k", type=int, default=4, help="decode: drafts a round (default 4)")
    parser.add_argument("--draft-quant", default="int4", help="decode: the draft's weights (default int4)")
    args = parser.parse_args(argv)
    results = Results("attention")
    name, _ = resolve_pair(args.pair)
    parts = args.parts.split(",")
    if "forwards" in parts:
        forwards(args, results, name)
    if "decode" in parts:
        decode(args, results, name)
    rows = results.rows()
    print(table([r for r in rows if r["part"] != "decode"], FORWARD_COLUMNS))
    print(table([r for r in rows if r["part"] == "decode"], DECODE_COLUMNS))
    print(f"wrote {results.finish({'pair': name, 'threads': torch.get_num_threads(), 'rounds': args.rounds})}")


if __name__ == "__main__":
    main()
