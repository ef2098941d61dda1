"""`python -m spec.sweep`: measure what speculation buys for each K, and what the speedup formula predicts.

One run, on one prompt set, with the same loop and the same token counter for every configuration:

- costs: one target step, one target forward over K + 1 new tokens (the verify factor v(K) = that / one step) and one
  draft step, each the median of a few trials on a cached prompt;
- for each repetition and prompt: plain decoding (the loop with drafter "none": the baseline), the draft model and
  prompt lookup at each K, adaptive K ("auto", `spec.policy.AdaptiveK`), and transformers' `generate` plain and with
  `assistant_model=` the draft, all greedy; then once per prompt and K the draft model sampling at temperature T, for
  alpha under sampling. A warm-up pass before all of it is not timed.

From the rows: alpha-hat (drafts accepted / drafts judged), c (seconds per draft step / seconds per plain round, from
the loop's own timings), the measured speedup over plain decoding on the same prompts (decode time: prefill
excluded; `x e2e` includes it, and is the one comparable with transformers' rows), and the predicted speedup
(1 - alpha^(K+1)) / ((1 - alpha)(K c + v)), with v = 1 (Leviathan et al.) and the measured v(K); for the draft model
also with tokens per round replayed from where its greedy runs disagreed (`calc.replayed_rounds`, exact for greedy).

Cost-only mode (`--alpha A`) skips generation: for random-weight models, whose acceptance means nothing, it measures
c and the verify curve and predicts the speedups at the acceptance A you give.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from spec import calc, log, plots
from spec.cli import add_model_args, load_from_args
from spec.harness import forward_times, hf_generate, run_loop, timed
from spec.io import RESULTS_DIR, Results, load_prompts, save_json, table
from spec.models import chat_ids, dtype_name
from spec.policy import AdaptiveK
from spec.remap import reencode
from spec.warps import Sampling

WARMUP_TOKENS = 16
LOOP_METHODS = ("plain", "draft", "lookup", "auto")
HF_METHODS = ("hf", "hf-assisted")
NOT_INDEPENDENT = (
    "Measured tokens per round differ from the formula's because acceptances are not independent: easy stretches "
    "(boilerplate, copied code) accept whole runs of drafts and hard ones reject early, while the formula assumes "
    "every draft is accepted with the same probability alpha. The replayed columns keep the clustering."
)


# ---- Measuring -------------------------------------------------------------------------------------------------------


def measure_costs(pair, ids: list[int], ks: list[int], trials: int) -> dict:
    """Target step, verify factor v(K) = forward(K + 1 tokens) / forward(1 token), draft step and c = their ratio."""
    prefix = ids[:-1] or ids
    sizes = sorted({1, *(k + 1 for k in ks)})
    bar = log.bar(total=len(sizes) + 1, desc="costs")
    target = {}
    for n in sizes:
        target[n] = statistics.median(forward_times(pair.target, prefix, [prefix[-1]] * n, trials))
        bar.update()
    draft_prefix = prefix
    if pair.draft_tokenizer is not None:  # another family: the draft reads the same text in its own ids
        draft_prefix = reencode(prefix, pair.tokenizer, pair.draft_tokenizer)
    draft_s = float("nan")
    if pair.draft is not None:
        draft_s = statistics.median(forward_times(pair.draft, draft_prefix, [draft_prefix[-1]], trials))
    bar.update()
    bar.close()
    pair.target.reset()
    step = target[1]
    return {
        "context": len(prefix), "trials": trials, "target_step_s": step, "draft_step_s": draft_s,
        "c": draft_s / step, "forward_s": {n: target[n] for n in sizes},
        "verify_factor": {k: target[k + 1] / step for k in ks},
    }


def loop_row(pair, method: str, k, ids: list[int], max_new_tokens: int, sampling: Sampling, seed: int) -> dict:
    """Run the loop once; one raw row of counts and seconds. For "auto", k is the AdaptiveK policy."""
    drafter = "none" if method == "plain" else "draft" if method == "auto" else method
    result = run_loop(pair, drafter, k, ids, max_new_tokens, sampling, seed)
    rejected = sum(1 for r in result.rounds if r.accepted < r.drafted)
    return {
        "method": method, "k": "auto" if method == "auto" else k, "tokens": len(result.tokens),
        "rounds": len(result.rounds), "drafted": result.drafted, "accepted": result.accepted, "rejected": rejected,
        "prefill_s": result.prefill_s, "decode_s": result.decode_s,
        "draft_s": sum(r.draft_s for r in result.rounds), "verify_s": sum(r.verify_s for r in result.rounds),
        "e2e_s": result.prefill_s + result.decode_s,
        "round_counts": [[r.drafted, r.accepted] for r in result.rounds],
        # per round: seconds drafting and in all, so that a slow configuration can be read round by round
        "round_times": [[round(r.draft_s, 7), round(r.total_s, 7)] for r in result.rounds],
        "policy": k.snapshot() if method == "auto" else None,  # adaptive K's estimates as this prompt ended
    }


def hf_row(pair, method: str, ids: list[int], max_new_tokens: int) -> dict:
    """transformers' own greedy `generate`, plain or assisted by the draft model; timed end to end (prefill too)."""
    assist = "draft" if method == "hf-assisted" else None
    tokens, seconds = timed(lambda: hf_generate(pair, ids, max_new_tokens, assist=assist), pair.device)
    return {"method": method, "k": None, "tokens": len(tokens), "rounds": None, "drafted": None,
            "accepted": None, "rejected": None, "prefill_s": None, "decode_s": None, "draft_s": None,
            "verify_s": None, "e2e_s": seconds, "round_counts": None, "round_times": None, "policy": None}


def run_config(pair, config: tuple[str, object], ids, max_new_tokens, sampling=Sampling(), seed=0) -> dict:
    method, k = config
    if method in HF_METHODS:
        return hf_row(pair, method, ids, max_new_tokens)
    return loop_row(pair, method, k, ids, max_new_tokens, sampling, seed)


def configs(methods: list[str], ks: list[int]) -> list[tuple[str, object]]:
    """The greedy configurations of one (repetition, prompt), plain first. Adaptive K is one policy for the whole
    sweep, as a server keeps one: it learns during the warm-up and carries its estimates from prompt to prompt."""
    out = [("plain", 0)]
    for method in methods:
        if method in ("draft", "lookup"):
            out += [(method, k) for k in ks]
        elif method == "auto":
            out.append(("auto", AdaptiveK(max_k=max(ks))))
        elif method == "hf":
            out += [(m, None) for m in HF_METHODS]
    return out


# ---- Aggregating (pure: rows in, summary out) ------------------------------------------------------------------------


def _sum(rows, key):
    return sum(r[key] for r in rows)


def _rate(rows, key) -> float:
    """Tokens per second over `rows` with time `key`."""
    seconds = _sum(rows, key)
    return _sum(rows, "tokens") / seconds if seconds > 0 else float("nan")


def alpha_hat(rows) -> float:
    """Drafts accepted / drafts judged. A round judges its drafts up to the first rejection, so accepted / drafted would
    understate alpha by an amount that grows with K."""
    judged = _sum(rows, "accepted") + _sum(rows, "rejected")
    return _sum(rows, "accepted") / judged if judged else float("nan")


def speedup_stats(rows: list[dict], plain: list[dict], key: str) -> tuple[float, float, float]:
    """(speedup, lowest, highest): tokens/s of `rows` over tokens/s of plain decoding on the same (rep, prompt)s,
    overall and per repetition (the spread)."""
    base = {(r["rep"], r["prompt"]): r for r in plain}
    matched = [r for r in rows if (r["rep"], r["prompt"]) in base]
    if not matched:
        return float("nan"), float("nan"), float("nan")

    def ratio(group):
        return _rate(group, key) / _rate([base[(r["rep"], r["prompt"])] for r in group], key)

    per_rep = [ratio([r for r in matched if r["rep"] == rep]) for rep in sorted({r["rep"] for r in matched})]
    return ratio(matched), min(per_rep), max(per_rep)


def summarize(rows: list[dict], costs: dict, ks: list[int]) -> dict:
    """One summary row per greedy configuration, plus the fitted alpha and c per drafter and the best Ks."""
    greedy = [r for r in rows if r["mode"] == "greedy"]
    plain = [r for r in greedy if r["method"] == "plain"]
    # One plain round is one target step as the loop pays it (forward, rule, bookkeeping).
    step_s = _sum(plain, "decode_s") / _sum(plain, "rounds")
    fits = {}
    for method in ("draft", "lookup"):
        fixed = [r for r in greedy if r["method"] == method]
        if fixed and _sum(fixed, "drafted"):
            fits[method] = {"alpha": alpha_hat(fixed), "c": _sum(fixed, "draft_s") / _sum(fixed, "drafted") / step_s}
    texts: dict = {}  # (rep, prompt) -> the draft model's runs of its text at every K: (tokens, rounds) each
    for r in greedy:
        if r["method"] == "draft" and r.get("round_counts"):
            texts.setdefault((r["rep"], r["prompt"]), []).append((r["tokens"], r["round_counts"]))
    table_rows = []
    for method, k in dict.fromkeys((r["method"], r["k"]) for r in greedy):
        group = [r for r in greedy if r["method"] == method and r["k"] == k]
        row = {"method": method, "k": k, "runs": len(group), "tokens": _sum(group, "tokens"),
               "tok_s_e2e": _rate(group, "e2e_s")}
        row["x_e2e"] = speedup_stats(group, plain, "e2e_s")[0]
        if method not in HF_METHODS:
            row["tok_s"] = _rate(group, "decode_s")
            row["x"], row["x_lo"], row["x_hi"] = speedup_stats(group, plain, "decode_s")
            row["tokens_per_round"] = _sum(group, "tokens") / _sum(group, "rounds")
            row["mean_k"] = _sum(group, "drafted") / _sum(group, "rounds")
            row["alpha"] = alpha_hat(group)
            drafted = _sum(group, "drafted")
            row["accept_rate"] = _sum(group, "accepted") / drafted if drafted else math.nan
        if method in fits:
            fit = fits[method]
            sampled = [r for r in rows if r["mode"] == "sample" and r["method"] == method and r["k"] == k]
            row["alpha_sample"] = alpha_hat(sampled) if sampled else math.nan
            row["verify_factor"] = costs["verify_factor"][k]
            row["predicted_tokens_per_round"] = calc.expected_tokens(fit["alpha"], k)
            row["predicted_x"] = calc.speedup(fit["alpha"], k, fit["c"])
            row["predicted_x_v"] = calc.speedup(fit["alpha"], k, fit["c"], costs["verify_factor"][k])
            if method == "draft":  # prompt lookup's guesses depend on the round's start, not only on the text
                tpr = row["replayed_tokens_per_round"] = calc.replayed_tokens_per_round(texts.values(), k, fit["alpha"])
                row["predicted_x_replayed"] = tpr / calc.round_cost(k, fit["c"], costs["verify_factor"])
        table_rows.append(row)
    best = {}
    drafted = [r for r in table_rows if r["method"] == "draft"]
    if drafted and "draft" in fits:
        # K = 0 (plain decoding, 1x by definition) competes too: with a poor draft it is the best K.
        plain_row = next(r for r in table_rows if r["method"] == "plain")
        measured = max([plain_row, *drafted], key=lambda r: r["x"])
        best["measured"] = {"k": measured["k"], "x": measured["x"]}
        fit = fits["draft"]
        k, x = calc.best_k(fit["alpha"], fit["c"], max(ks), costs["verify_factor"], ks=ks)
        best["predicted"] = {"k": k, "x": x}
        if texts:
            top = max([plain_row, *drafted], key=lambda r: r.get("predicted_x_replayed", 1.0))
            best["predicted_replayed"] = {"k": top["k"], "x": top.get("predicted_x_replayed", 1.0)}
        auto = [r for r in table_rows if r["method"] == "auto"]
        if auto:
            best["auto"] = {"x": auto[0]["x"], "of_best_fixed": auto[0]["x"] / measured["x"]}
    return {"target_round_s": step_s, "fits": fits, "rows": table_rows, "best": best}


def predict(alpha: float, costs: dict, ks: list[int]) -> list[dict]:
    """Cost-only mode: predicted speedups at a given alpha from the measured c and verify factors."""
    c, v = costs["c"], costs["verify_factor"]
    return [{"method": "draft", "k": k, "verify_factor": v[k],
             "predicted_tokens_per_round": calc.expected_tokens(alpha, k),
             "predicted_x": calc.speedup(alpha, k, c), "predicted_x_v": calc.speedup(alpha, k, c, v)} for k in ks]


# ---- Reporting -------------------------------------------------------------------------------------------------------

COLUMNS = [
    ("method", ""), ("k", ""), ("alpha", ".3f"), ("alpha_sample", ".3f"), ("tokens_per_round", ".2f"),
    ("predicted_tokens_per_round", ".2f"), ("mean_k", ".2f"), ("verify_factor", ".3f"), ("predicted_x", ".2f"),
    ("predicted_x_v", ".2f"), ("replayed_tokens_per_round", ".2f"), ("predicted_x_replayed", ".2f"),
    ("x", ".2f"), ("spread", ""), ("x_e2e", ".2f"), ("tok_s_e2e", ".2f"),
]
COST_COLUMNS = [("k", ""), ("verify_factor", ".3f"), ("predicted_tokens_per_round", ".2f"), ("predicted_x", ".2f"),
                ("predicted_x_v", ".2f")]


def printable(rows: list[dict]) -> list[dict]:
    """Rows for the table: a `spread` column (lowest..highest per-repetition speedup), and no NaN or None cells
    (they print as a dash)."""
    out = []
    for row in rows:
        lo, hi = row.get("x_lo"), row.get("x_hi")
        row = {**row, "spread": f"{lo:.2f}..{hi:.2f}" if lo is not None and hi != lo else None}
        out.append({k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))})
    return out


# ---- The task --------------------------------------------------------------------------------------------------------


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes a comma-separated list of whole numbers, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k needs at least one K and every K >= 1, got {text!r}")
    return ks


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(methods) - {"draft", "lookup", "auto", "hf"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}; choose from draft, lookup, auto, hf")
    return methods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spec.sweep",
        description="Measure alpha, c and the verify cost for each K, the speedup they buy over plain decoding, "
        "and what the speedup formula predicts; adaptive K and transformers' assisted generation as extra rows.",
        epilog="Examples: `python -m spec.sweep --pair qwen-coder --prompts short --limit 4 --max-new-tokens 64 "
        "--k 1,2,3,4,6,8 --reps 1` (CPU);  `python -m spec.sweep --pair llama-random --alpha 0.8` (GPU, cost only). "
        "Writes results/sweep-<time>.json (raw rows + summary) and a PNG beside it. The formula and how to read "
        "the table: docs/tuning.md.",
    )
    add_model_args(parser)
    g = parser.add_argument_group("sweep")
    g.add_argument("--prompts", default="short", help="prompt set name in prompts/ or a .jsonl path (default short)")
    g.add_argument("--limit", type=int, default=20, help="use the first N prompts (default 20)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt (default 256)")
    g.add_argument("--k", type=parse_ks, default=list(range(1, 9)), help="Ks to sweep, e.g. 1,2,4,8 (default 1..8)")
    g.add_argument("--methods", type=parse_methods, default=["draft", "lookup", "auto", "hf"],
                   help="what to compare with plain decoding: draft (the draft model at each K), lookup (prompt "
                   "lookup at each K), auto (adaptive K up to the largest K), hf (transformers' generate, plain and "
                   "assisted). Default: all")
    g.add_argument("--reps", type=int, default=3, help="timed repetitions of every configuration (default 3)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="temperature of the sampling pass that measures alpha under sampling; 0 skips it (default 1)")
    g.add_argument("--trials", type=int, default=5, help="trials per forward in the cost measurement (default 5)")
    g.add_argument("--alpha", type=float,
                   help="cost-only mode: generate nothing; measure c and the verify factors and predict the speedup "
                   "at this acceptance (for random-weight models, e.g. --pair llama-random --alpha 0.8)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling pass (default 0)")
    g.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and PNG (default results/)")
    return parser


def check_args(parser, args) -> None:
    if args.limit < 1 or args.max_new_tokens < 1 or args.reps < 1 or args.trials < 1:
        parser.error("--limit, --max-new-tokens, --reps and --trials must be >= 1")
    if args.alpha is not None and not 0 <= args.alpha <= 1:
        parser.error(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    prompts = load_prompts(args.prompts)[: args.limit]
    pair = load_from_args(args, with_draft=args.alpha is not None or bool({"draft", "auto", "hf"} & set(args.methods)))
    ids = [chat_ids(pair.tokenizer, p["prompt"]) for p in prompts]
    longest = max(len(i) for i in ids) + args.max_new_tokens
    if longest > pair.target.max_length:
        parser.error(f"the longest prompt plus --max-new-tokens is {longest} tokens, over the target's context of "
                     f"{pair.target.max_length}")
    if pair.draft_tokenizer is not None and "hf" in args.methods:
        log.info("transformers' assisted generation needs one tokenizer: the hf rows are skipped for this pair")
        args.methods.remove("hf")

    title = f"{pair.name} on {pair.device}, {len(prompts)} prompts x {args.max_new_tokens} tokens"
    setup = {"pair": pair.name, "device": str(pair.device), "dtype": dtype_name(pair.dtype),
             **pair.setup_fields(),
             "prompts": args.prompts, "limit": len(prompts), "max_new_tokens": args.max_new_tokens, "ks": args.k,
             "methods": args.methods, "reps": args.reps, "temperature": args.temperature, "seed": args.seed}
    if args.alpha is not None:
        return cost_only(args, pair, ids[0], f"{pair.name} on {pair.device}", setup)
    return full(args, pair, prompts, ids, title, setup)


def cost_only(args, pair, ids: list[int], title: str, setup: dict) -> dict:
    costs = measure_costs(pair, ids, args.k, args.trials)
    rows = predict(args.alpha, costs, args.k)
    print(f"cost only, {title}: target step {costs['target_step_s'] * 1e3:.2f} ms, draft step "
          f"{costs['draft_step_s'] * 1e3:.2f} ms, c = {costs['c']:.3f} (context {costs['context']} tokens)")
    print(table(rows, COST_COLUMNS))
    k, x = calc.best_k(args.alpha, costs["c"], max(args.k), costs["verify_factor"], ks=args.k)
    print(f"best K predicted at alpha {args.alpha} = {k} ({x:.2f}x, measured verify factors)")
    data = {"mode": "cost-only", "alpha": args.alpha, "setup": setup, "costs": costs, "summary": rows}
    out = save_json("sweep", data, args.out)
    plots.sweep(rows, costs, costs["c"], out.with_suffix(".png"), f"predicted at alpha {args.alpha}: {title}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return data


def full(args, pair, prompts: list[dict], ids: list[list[int]], title: str, setup: dict) -> dict:
    greedy = configs(args.methods, args.k)
    # Graphs for every K and every text length the prompts reach, before anything is timed: plain decoding runs first
    # on each prompt, so a capture at a new length would otherwise land in the baseline.
    pair.prepare(max(args.k), max(map(len, ids)) + args.max_new_tokens)
    for cfg in greedy:  # warm-up: allocator, kernels, lazy imports, and adaptive K's first estimates; never timed
        run_config(pair, cfg, ids[0], min(WARMUP_TOKENS, args.max_new_tokens))
    costs = measure_costs(pair, ids[0], args.k, args.trials)
    results, raw = Results("sweep", args.out), []  # each raw row is on disk as soon as it is measured
    sample_ks = args.k if args.temperature > 0 and "draft" in args.methods else []
    sampling = Sampling(temperature=args.temperature) if sample_ks else None
    with log.bar(total=args.reps * len(prompts) * len(greedy) + len(prompts) * len(sample_ks), desc="sweep") as bar:
        for rep in range(args.reps):
            for prompt, prompt_ids in zip(prompts, ids):
                for cfg in greedy:
                    raw.append(results.add({"rep": rep, "prompt": prompt["id"], "mode": "greedy",
                                            **run_config(pair, cfg, prompt_ids, args.max_new_tokens)}))
                    bar.update()
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            for k in sample_ks:
                row = run_config(pair, ("draft", k), prompt_ids, args.max_new_tokens, sampling, args.seed + i)
                raw.append(results.add({"rep": 0, "prompt": prompt["id"], "mode": "sample", **row}))
                bar.update()

    summary = summarize(raw, costs, args.k)
    print(f"{title}, {args.reps} rep(s); plain decoding {summary['rows'][0]['tok_s']:.2f} tok/s; verify factor from "
          f"forwards on a {costs['context']}-token prompt; c from the loop's rounds")
    for method, fit in summary["fits"].items():
        print(f"  {method}: alpha-hat {fit['alpha']:.3f} (greedy, all Ks), c = {fit['c']:.3f}")
    print(table(printable(summary["rows"]), COLUMNS))
    best = summary["best"]
    if "measured" in best:
        print(f"best K measured = {best['measured']['k']} ({best['measured']['x']:.2f}x); best K predicted = "
              f"{best['predicted']['k']} ({best['predicted']['x']:.2f}x, measured verify factors)")
    if "predicted_replayed" in best:
        print(f"best K predicted from where the draft disagreed = {best['predicted_replayed']['k']} "
              f"({best['predicted_replayed']['x']:.2f}x)")
    if "auto" in best:
        print(f"auto: {best['auto']['x']:.2f}x, {best['auto']['of_best_fixed']:.0%} of the best fixed K")
    print(NOT_INDEPENDENT)
    data = {"mode": "full", "setup": setup, "costs": costs, "summary": summary}
    out = results.finish(data)
    data["rows"] = raw
    if "draft" in summary["fits"]:
        plots.sweep(summary["rows"], costs, summary["fits"]["draft"]["c"], out.with_suffix(".png"), title)
        print(f"wrote {out} and {out.with_suffix('.png')}")
    else:
        print(f"wrote {out}")
    return data


if __name__ == "__main__":
    main()
