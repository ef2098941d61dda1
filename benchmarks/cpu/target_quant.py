"""Quantized targets and drafts side by side, one process: for each (target, draft) format, plain and speculative
greedy decoding on the same prompts, and the quantized target's greedy agreement and mean KL against the bf16
target (spec/models/quant_report.py). A quantized target CHANGES THE MODEL: identity here is against it.

    python benchmarks/cpu/target_quant.py --pair qwen-coder --prompts short,code --limit 3 --max-new-tokens 64

The first format pair (default none/none) is the unquantized baseline; its target writes the reference text once,
and every later load is scored against that same reference (no second bf16 run). Each format loads the pair again
(weights from the user cache, packed layers from the quantized cache once built), so every speedup is over plain
decoding of the same target in the same load. llama.cpp's numbers are quoted from issue 18 (llama-bench, the same
Q4_K_M files, 2 threads), or measured in the run with `--llama-bench PATH`. `plain_tok_s`, `spec_tok_s` and `speedup`
are end to end (the prompt's forward included); the ratios to llama.cpp compare decoding alone, as llama-bench's
text-generation test times it (`*_decode_tok_s`: tokens over the rounds' time). Rows go to
results/target_quant-<time>.jsonl as they come.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.cli import add_model_args, load_from_args  # noqa: E402
from spec.harness import Setup, run_prompt  # noqa: E402
from spec.io import Results, load_prompts, table  # noqa: E402
from spec.models import cache_root, chat_ids  # noqa: E402
from spec.models.packaged import PACKAGED, assemble_gguf  # noqa: E402
from spec.models.pairs import PAIRS, resolve_pair  # noqa: E402
from spec.models.quant_report import compare, reference_run  # noqa: E402

LLAMA_CPP_QUOTED = {"target_plain_tok_s": 12.5, "draft_plain_tok_s": 28.3,
                    "source": "issue 18: llama-bench, the same Q4_K_M files, 2 threads (quoted, not re-run)"}
COLUMNS = [("formats", ""), ("prompts", ""), ("k", ""), ("identical", ""), ("agreement", ".3f"), ("kl_mean", ".4f"),
           ("alpha", ".3f"), ("tokens_per_round", ".2f"), ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"),
           ("speedup", ".2f"), ("plain_decode_tok_s", ".2f"), ("spec_decode_tok_s", ".2f"),
           ("plain_vs_llama_cpp", ".2f"), ("spec_vs_llama_cpp", ".2f")]


def llama_bench(binary: str, pair: str, threads: int, tokens: int, reps: int = 3) -> dict:
    """llama.cpp's own decode speed (llama-bench's text-generation test, no prompt) for the pair's target and draft
    GGUF files, with `threads` threads: tok/s (median of its `reps` repetitions; the spread is kept)."""
    spec = PAIRS[resolve_pair(pair)[0]]
    refs = {"target": spec.target, "draft": spec.draft}
    if not all(ref.startswith("packaged:") for ref in refs.values()):
        raise SystemExit(f"--llama-bench needs a packaged pair (qwen-coder): the GGUF files of pair {pair!r} are not "
                         "known here")
    out = {"binary": str(Path(binary).resolve()), "threads": threads, "tokens": tokens, "reps": reps}
    for role, ref in refs.items():
        gguf = assemble_gguf(PACKAGED[ref.split(":", 1)[1]], cache_root() / "gguf")
        run = subprocess.run([binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
                              "-r", str(reps), "-o", "json"], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"llama-bench failed on {gguf.name}:\n{run.stderr[-2000:]}")
        test = json.loads(run.stdout)[0]
        out[role] = {"file": gguf.name, "tok_s": statistics.median(test["samples_ts"]),
                     "samples_tok_s": test["samples_ts"], "build": test.get("build_commit"),
                     "cpu": test.get("cpu_info")}
    return out


def summarise(formats: str, prompts: str, k: int, rows: list[dict], per: list[dict], llama_target: float) -> dict:
    """One (formats, prompt set, K) line: identity, the quantized target's agreement and KL on these prompts
    (`per`: the report's rows for them), alpha-hat, tokens per round, tok/s and the ratios."""
    positions = sum(r["positions"] for r in per)
    drafted = sum(r["spec"]["drafted"] for r in rows)
    tokens, plain_s, spec_s = (sum(r[key] for r in rows) for key in ("tokens", "plain_s", "spec_s"))
    line = {
        "formats": formats, "prompts": prompts, "k": k, "identical": all(r["identical"] for r in rows),
        "divergences": [{"id": r["id"], **r["divergence"]} for r in rows if "divergence" in r],
        "agreement": sum(r["agreement"] * r["positions"] for r in per) / positions,
        "kl_mean": sum(r["kl_mean"] * r["positions"] for r in per) / positions,
        "alpha": sum(r["spec"]["accepted"] for r in rows) / drafted if drafted else float("nan"),
        "tokens_per_round": tokens / sum(r["spec"]["rounds"] for r in rows),
        "plain_tok_s": sum(r["plain_tokens"] for r in rows) / plain_s, "spec_tok_s": tokens / spec_s,
    }
    line["speedup"] = line["spec_tok_s"] / line["plain_tok_s"]
    # llama-bench's text generation (-p 0) times its token steps only, so the ratios to it leave out our prompt's
    # forward too: tokens over the time in rounds (`Result.tok_s`), with the end-to-end rates above kept beside them.
    for side in ("plain", "spec"):
        line[f"{side}_decode_tok_s"] = sum(r[side]["tokens"] for r in rows) / sum(r[side]["decode_s"] for r in rows)
        line[f"{side}_vs_llama_cpp"] = line[f"{side}_decode_tok_s"] / llama_target
    return line


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--formats", default="none/none,int8/int8,int4/int4",
                        help="target/draft format pairs; the first must be none/none (default "
                             "none/none,int8/int8,int4/int4)")
    parser.add_argument("--prompts", default="short,code", help="prompt sets (default short,code)")
    parser.add_argument("--limit", type=int, default=3, help="prompts per set (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--backends", help="backends to run each format on, in turn (e.g. eager,graph; default: "
                        "--backend's one); the reference text is written once, on the first")
    parser.add_argument("--k", default="4", help="drafts per round, or several to run each (e.g. 1,4; default 4)")
    parser.add_argument("--llama-bench", metavar="PATH",
                        help="a llama-bench binary: measure llama.cpp on the same GGUF files and threads in this run "
                             "(before and after ours), instead of quoting issue 18's figures")
    args = parser.parse_args(argv)
    formats = [tuple(f.split("/")) for f in args.formats.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    backends = args.backends.split(",") if args.backends else [args.backend]
    if formats[0] != ("none", "none"):
        parser.error("the first --formats entry must be none/none: it is the reference every other is scored on")
    sets = {name: load_prompts(name)[: args.limit] for name in args.prompts.split(",")}
    everything = [p for prompts in sets.values() for p in prompts]
    results, summary, loads, reference = Results("target_quant"), [], [], None
    threads = torch.get_num_threads()
    llama_cpp = [llama_bench(args.llama_bench, args.pair, threads, args.max_new_tokens)] if args.llama_bench else []
    llama_target = llama_cpp[0]["target"]["tok_s"] if llama_cpp else LLAMA_CPP_QUOTED["target_plain_tok_s"]
    for (target_quant, draft_quant), backend in ((f, b) for f in formats for b in backends):
        args.target_quant, args.draft_quant, args.backend = target_quant, draft_quant, backend
        label = f"{target_quant}/{draft_quant}" + (f" {backend}" if len(backends) > 1 else "")
        pair = load_from_args(args, reference=reference)
        if reference is None:  # the bf16 target, before any quantization: the one reference text
            reference = reference_run(pair.target, [chat_ids(pair.tokenizer, p["prompt"]) for p in everything],
                                      args.max_new_tokens, pair.eos)
        # an unquantized target on another backend is scored on the same reference too
        report = pair.target_report if target_quant != "none" else compare(pair.target, reference, "none")
        loads.append({"formats": label, "backend": type(pair.target).__name__, "load_seconds": pair.load_seconds,
                      "target_weight_bytes": pair.target.weight_bytes(),
                      "draft_weight_bytes": pair.draft.weight_bytes(),
                      "report": report})
        run_prompt(pair, everything[0], Setup(k=ks[0], max_new_tokens=8), ks[0])  # warm-up, untimed
        for k in ks:
            start = 0
            for name, prompts in sets.items():
                rows = [results.add({"formats": label, "set": name, "k": k,
                                     **run_prompt(pair, p, Setup(k=k, max_new_tokens=args.max_new_tokens), k)})
                        for p in prompts]
                per = report["per_prompt"][start: start + len(prompts)]
                start += len(prompts)
                summary.append(summarise(label, f"{name} x{len(rows)}", k, rows, per,
                                         llama_target))
        del pair
    if args.llama_bench:  # again after ours: a machine that got busier shows up as two different figures
        llama_cpp.append(llama_bench(args.llama_bench, args.pair, threads, args.max_new_tokens))
    print(table(summary, COLUMNS))
    if llama_cpp:
        for role in ("target", "draft"):
            speeds = " then ".join(f"{run[role]['tok_s']:.2f}" for run in llama_cpp)
            print(f"llama.cpp llama-bench, {role} {llama_cpp[0][role]['file']}, {threads} threads, "
                  f"{args.max_new_tokens} tokens: {speeds} tok/s (before ours, after)")
    else:
        print(f"llama.cpp (quoted, not re-run): target {LLAMA_CPP_QUOTED['target_plain_tok_s']} tok/s plain, draft "
              f"{LLAMA_CPP_QUOTED['draft_plain_tok_s']} tok/s; {LLAMA_CPP_QUOTED['source']}")
    setup = {**vars(args), "formats": [f"{t}/{d}" for t, d in formats], "backends": backends, "threads": threads,
             **({"llama_cpp": llama_cpp} if llama_cpp else {"llama_cpp_quoted": LLAMA_CPP_QUOTED})}
    for key in ("target_quant", "draft_quant", "backend"):
        setup.pop(key)  # each row names its own
    out = results.finish({"setup": setup, "loads": loads, "summary": summary})
    print(f"wrote {out}")
    return {"summary": summary, "loads": loads}


if __name__ == "__main__":
    main()
