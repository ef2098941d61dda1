"""Chains against token trees on real text: the tree calculator's prediction for every static shape, and measured runs
of the chain at K = 4 and the shapes it picks, side by side.

    python -m spec.tree_sweep --pair qwen-coder --prompts code --limit 3 --max-new-tokens 64

How the prediction is made (spec/calc.py): one plain greedy run per prompt gives the target's text; one draft forward
over that text gives, at every position, the rank of the target's token among the draft's choices. Under greedy
decoding a tree of top-b children accepts depth d exactly when that rank is below b_d, so replaying the ranks gives
each shape's tokens per target forward without running it. Timed forwards of the draft (over 1..8 tokens) and of
the target (over 1..nodes+1 tokens, as a tree's verify reads them, and as a chain's) give each shape's round cost,
in target steps, with the draft's catch-up after rounds that accept every depth (its first forward then reads two
tokens). What a round takes beyond those forwards (the rule, the trees' masks, the drafter's choices; less what
back-to-back forwards save) is fitted to short runs of a few shapes on the first prompt (`calibrate`), and plain
decoding's seconds a token are the baseline. Then the chain at K = 4, the best
chain, the best tree by predicted speed and the tree with the most tokens per forward (within --max-nodes) run
for real through the loop: tokens per target forward, decode speed against plain decoding, and identity. So do a
dynamic tree of --max-nodes nodes (EAGLE-2's, at most --max-depth deep) and the tree policy (`--tree auto`: one
policy learning over the prompts, as a server's would), which the replay cannot predict (their trees depend on the
draft's probabilities, or on what the policy has measured); their "nodes" is the mean nodes a round.

Writes results/tree_sweep-<time>.json (+ .jsonl rows as they finish, + .png).
"""

from __future__ import annotations

import argparse
import statistics

import numpy
import scipy.optimize
import torch

from spec import calc, log, plots
from spec.cli import add_model_args, load_from_args
from spec.harness import explain_divergence, forward_times, run_loop
from spec.io import Results, load_prompts, table
from spec.models import chat_ids, dtype_name
from spec.policy import TreePolicy, is_tree
from spec.tree import Auto, Dynamic, branches, describe, most_nodes, nodes_of, parse_tree, widths


def calibration_shapes(max_nodes: int, max_depth: int) -> list[tuple[int, ...]]:
    """Shapes whose short runs calibrate what a round takes beyond its forwards (`calibrate`): chains, and trees
    with 1-3 draft forwards under a tree mask, so that a tree round's cost and a masked forward's are told apart,
    within the sweep's limits (smaller ones where those leave fewer than four)."""
    fits = [s for s in ((1,), (1, 1, 1, 1), (2, 2), (2, 1, 1, 1), (4, 2))
            if nodes_of(s) <= max_nodes and len(s) <= max_depth]
    if len(fits) < 4:
        fits += [s for s in ((1,) * min(4, max_depth), (2, 1), (min(4, max_nodes),))
                 if s not in fits and nodes_of(s) <= max_nodes and len(s) <= max_depth]
    return fits


def ranks_of(pair, ids: list[int], tokens: list[int]) -> list[int]:
    """The draft's rank of each generated token (0 = its argmax) after the true text before it: one forward."""
    pair.draft.reset()
    logits = pair.draft.forward(ids + tokens[:-1], keep=len(tokens))  # row j predicts tokens[j]
    pair.draft.reset()
    chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])
    return (logits > chosen).sum(-1).tolist()


def costs(pair, context: list[int], max_width: int, max_tokens: int, max_chain: int, trials: int
          ) -> tuple[dict, dict, dict, float]:
    """(draft forward of w tokens, target forward of n tokens as a tree's verify reads them, the same as a chain's
    verify reads them, up to max_chain + 1 tokens), in target steps, and the step in seconds. The two verifies take
    different paths: a chain's is a plain forward (on the graph backend through the layer stack past 16 tokens,
    and one-token steps up to its stepwise limit for packed weights), a tree's carries a tree mask (fused up to 64)."""
    with log.bar(total=max_width + max_tokens + max_chain, desc="timing forwards") as bar:
        tree, chain = {}, {}
        for n in range(1, max_tokens + 1):
            tree[n] = statistics.median(forward_times(pair.target, context, context[-n:], trials, as_tree=n > 1))
            bar.update()
        for n in range(1, max_chain + 2):
            chain[n] = tree[1] if n == 1 else statistics.median(forward_times(pair.target, context, context[-n:],
                                                                              trials))
            bar.update()
        draft = {}
        for w in range(1, max_width + 1):
            draft[w] = statistics.median(forward_times(pair.draft, context, context[-w:], trials))
            bar.update()
    pair.target.reset()
    pair.draft.reset()
    step = tree[1]
    return ({w: s / step for w, s in draft.items()}, {n: s / step for n, s in tree.items()},
            {n: s / step for n, s in chain.items()}, step)


def host_terms(shape) -> tuple[int, int]:
    """(draft forwards under a tree mask, 1 for a tree's verify) of a round of a static shape: each draft forward
    after the first feeds a depth's nodes (`widths` but the last), under a tree mask once that depth is wider than
    one node (some depth before it branched); `fit_host` reads the same from a round's forwards."""
    return sum(1 for w in widths(shape)[:-1] if w > 1), int(branches(shape))


def host_seconds(host: dict, shape) -> float:
    """A round's time outside its timed forwards, from the fit `calibrate` makes (seconds)."""
    masked, tree_round = host_terms(shape)
    return host["round_s"] + host["masked_forward_s"] * masked + host["tree_s"] * tree_round


def predict(shapes, texts: list[list[int]], draft_cost: dict, verifies: tuple[dict, dict], step: float,
            host: dict) -> list[dict]:
    """Each shape's replayed tokens per target forward, its round cost and predicted decode speedup over plain
    decoding: tokens a round x plain decoding's seconds a token / the round's seconds, where a round costs its
    forwards (`calc.tree_round_cost`, the catch-up after full rounds included) and the rest of its time
    (`calibrate`), and a plain token what plain decoding measured. `forwards_only_speedup` is the calculator's
    speedup from the forwards alone (tokens a round / their cost in target steps)."""
    out = []
    for shape in shapes:
        tokens = rounds = full = 0
        for ranks in texts:
            replay = calc.replayed_tree_tokens(ranks, shape)
            tokens, rounds, full = tokens + replay.tokens, rounds + replay.rounds, full + replay.full
        per_round = tokens / rounds
        verify = verifies[not branches(shape)]  # (a tree's, a chain's)
        bare = calc.tree_round_cost(shape, draft_cost, verify)
        cost = calc.tree_round_cost(shape, draft_cost, verify, full=full / rounds)
        round_s = cost * step + host_seconds(host, shape)
        out.append({"shape": ",".join(map(str, shape)), "depth": len(shape), "nodes": nodes_of(shape),
                    "chain": not branches(shape), "tokens_per_forward": per_round, "full_rounds": full / rounds,
                    "cost_steps": cost, "host_steps": round_s / step - cost,
                    "forwards_only_speedup": per_round / bare,
                    "predicted_speedup": per_round * host["plain_token_s"] / round_s})
    return out


def fit_host(rounds, draft_cost: dict, verifies: tuple[dict, dict], step: float) -> tuple[list[float], int]:
    """([round_s, masked_forward_s, tree_s], rounds used): least squares of each round's time less the forwards it
    made, timed alone (the draft's, the catch-up's width included, and the target's over the tokens it verified: a
    tree's verify or a chain's, `verifies`), on 1, its draft forwards under a tree mask and whether it was a tree
    round; round_s free in sign, the tree terms at least 0. Rounds with no draft forward, or a forward or verify
    width not timed, are left out; fewer than three rounds give zeros."""
    rows, seconds = [], []
    for r in rounds:
        verify = verifies[not is_tree(r)]  # a tree round's verify carries its mask, a chain's does not
        if not r.forwards or max(r.forwards) not in draft_cost or r.verified not in verify:
            continue
        rows.append([1.0, sum(1 for w in r.forwards[1:] if w > 1), int(is_tree(r))])  # as `host_terms` counts them
        seconds.append(r.total_s - (sum(draft_cost[w] for w in r.forwards) + verify[r.verified]) * step)
    if len(rows) < 3:
        return [0.0, 0.0, 0.0], len(rows)
    bounds = ([-numpy.inf, 0.0, 0.0], [numpy.inf, numpy.inf, numpy.inf])
    return [float(c) for c in scipy.optimize.lsq_linear(numpy.array(rows), numpy.array(seconds), bounds=bounds).x], \
        len(rows)


def calibrate(pair, ids: list[int], n: int, shapes, draft_cost: dict, verifies: tuple[dict, dict], step: float,
              plain_token_s: float) -> dict:
    """A round's time outside its timed forwards, in seconds (`fit_host`), from short runs of `shapes` on one
    prompt, their first two rounds left out: round_s is what every round pays beyond its forwards, less what its
    back-to-back forwards save against forwards timed one by one (negative on a GPU, where a chain's draft forwards
    overlap their launches); tree_s what a tree round pays more (its verify's mask and rule), masked_forward_s each
    draft forward under a tree mask. Session 19's H100 rounds (real pair, int8 draft): chains -0.1 target steps, a
    `2,2` tree +0.5, a deep tree's masked draft forwards +0.15 each. The rounds are kept for reports."""
    rounds, kept = [], []
    for shape in shapes:
        k, tree = loop_setting(shape, len(shape))
        for r in run_loop(pair, "draft", k, ids, n, tree=tree).rounds[2:]:
            rounds.append(r)
            kept.append([",".join(map(str, shape)), list(r.forwards), r.verified, r.total_s])
    (round_s, masked_forward_s, tree_s), used = fit_host(rounds, draft_cost, verifies, step)
    return {"plain_token_s": plain_token_s, "plain_s": plain_token_s - step, "round_s": round_s,
            "masked_forward_s": masked_forward_s, "tree_s": tree_s, "rounds": used,
            "shapes": [",".join(map(str, s)) for s in shapes], "round_detail": kept}


def loop_setting(setting, max_depth: int) -> tuple:
    """(k, tree) for run_loop from a parsed --trees entry: a static shape (a chain of 1s runs as plain K), a
    dynamic tree, or a new tree policy (one for the whole prompt set, as a server keeps one across requests)."""
    if isinstance(setting, tuple):
        return len(setting), setting if branches(setting) else None
    if isinstance(setting, Dynamic):
        return max_depth, setting
    return TreePolicy(max_depth=max_depth, max_nodes=setting.max_nodes), None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m spec.tree_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    g = parser.add_argument_group("run")
    g.add_argument("--prompts", default="code", help="prompt set in prompts/ or a .jsonl path (default code)")
    g.add_argument("--limit", type=int, default=3, help="use the first N prompts (default 3; 0 = all)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    g.add_argument("--max-nodes", type=int, default=16, help="largest tree considered, in nodes (default 16)")
    g.add_argument("--max-depth", type=int, default=8, help="deepest tree considered (default 8)")
    g.add_argument("--trees", type=lambda text: [parse_tree(t) for t in text.split(";") if t.strip()],
                   default=None, help="more trees to run, ';'-separated: static shapes, dynamic:N[:W], auto[:N], "
                                      "e.g. '3,2,1;2,2,1,1;dynamic:8' (default: dynamic:MAX_NODES;auto:MAX_NODES)")
    g.add_argument("--trials", type=int, default=3, help="timed forwards per size (median; default 3)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2 or not 1 <= args.max_nodes <= 64 or args.max_depth < 1 or args.trials < 1:
        parser.error("--max-new-tokens >= 2, --max-nodes in 1..64, --max-depth >= 1 and --trials >= 1")
    if args.trees is None:
        args.trees = [Dynamic(args.max_nodes, min(4, args.max_nodes)), Auto(args.max_nodes)]
    return args


def parting_summary(measured: list[dict]) -> str | None:
    """How many measured runs (each shape's prompts) wrote other text than plain greedy decoding, and how many of
    those parted at a near-tie of the target's top two logits; None where none parted."""
    parted = sum(row["parted"] for row in measured)
    if not parted:
        return None
    ties = sum(row["near_ties"] for row in measured)
    return (f"{parted} run(s) parted from plain greedy decoding; {ties} at a near-tie of the target's top two logits "
            "(closer than the rounding difference between the forward shapes: docs/exactness.md)"
            + ("" if ties == parted else f"; {parted - ties} NOT at a near-tie: a bug"))


def main(argv=None) -> dict:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)[: args.limit or None]
    pair = load_from_args(args)
    results = Results("tree_sweep")
    n = args.max_new_tokens

    ids_of = {prompt["id"]: chat_ids(pair.tokenizer, prompt["prompt"]) for prompt in prompts}
    # Every graph the runs below can meet is captured before any of them is timed, plain decoding's too (it is every
    # speedup's baseline): a new node count or text length would otherwise pay for a capture, and its kernels for a
    # compile, inside a timed run. Chains go up to K = 8 (the best chain is chosen among them).
    depth = max([8, args.max_depth, *(len(t) for t in args.trees if isinstance(t, tuple))])
    pair.prepare(depth, max(map(len, ids_of.values())) + n, max([args.max_nodes, *map(most_nodes, args.trees)]))
    plain, texts = {}, []
    for prompt in log.bar(iterable=prompts, desc="plain + ranks"):
        ids = ids_of[prompt["id"]]
        plain[prompt["id"]] = run_loop(pair, "none", 0, ids, n)
        texts.append(ranks_of(pair, ids, plain[prompt["id"]].tokens))
    ranks = [r for text in texts for r in text]
    rank_probs = [sum(1 for r in ranks if r == i) / len(ranks) for i in range(4)]

    shapes = calc.tree_shapes(args.max_nodes, args.max_depth)
    chains = [(1,) * k for k in range(1, 9)]
    static = [t for t in args.trees if isinstance(t, tuple)]
    calibration = calibration_shapes(args.max_nodes, args.max_depth)
    longest = max(2, *(max(widths(s)[:-1] or [1]) for s in [*shapes, *static, *calibration]))  # 2: the catch-up
    first_ids = ids_of[prompts[0]["id"]]
    context = first_ids + plain[prompts[0]["id"]].tokens
    longest_chain = max(len(s) for s in [*chains, *static, *calibration] if not branches(s))
    draft_cost, verify, verify_chain, step = costs(pair, context, longest, max(
        nodes_of(s) for s in [*shapes, *chains, *static]) + 1, longest_chain, args.trials)
    plain_token_s = sum(r.decode_s for r in plain.values()) / sum(len(r.tokens) for r in plain.values())
    host = calibrate(pair, first_ids, min(n, 32), calibration, draft_cost, (verify, verify_chain), step,
                     plain_token_s)
    predicted = predict(sorted({*shapes, *chains, *static}, key=lambda s: (nodes_of(s), s)), texts, draft_cost,
                        (verify, verify_chain), step, host)
    by_shape = {p["shape"]: p for p in predicted}
    best_chain = max((p for p in predicted if p["chain"]), key=lambda p: p["predicted_speedup"])
    trees = [p for p in predicted if not p["chain"] and p["nodes"] <= args.max_nodes]
    best_tree = max(trees, key=lambda p: p["predicted_speedup"])
    deepest = max(trees, key=lambda p: (p["tokens_per_forward"], -p["nodes"]))
    runs = ["1,1,1,1", best_chain["shape"], best_tree["shape"], deepest["shape"], *map(describe, args.trees)]
    runs = list(dict.fromkeys(runs))

    settings = [parse_tree(text) for text in runs]
    for setting in settings:  # one short untimed run of each (whatever its first rounds meet first)
        k, tree = loop_setting(setting, args.max_depth)
        run_loop(pair, "draft", k, first_ids, min(8, n), tree=tree)

    measured = []
    nan = float("nan")
    for shape_text, setting in log.bar(iterable=list(zip(runs, settings)), desc="measured runs"):
        k, tree = loop_setting(setting, args.max_depth)
        tokens = rounds = drafted = 0
        spec_s = plain_s = 0.0
        identical = near_ties = 0
        for prompt in prompts:
            ids = ids_of[prompt["id"]]
            result = run_loop(pair, "draft", k, ids, n, tree=tree)
            base = plain[prompt["id"]]
            same = result.tokens == base.tokens
            identical += same
            if not same:
                # the chain-shaped check as deep as the run went, and a tree-shaped one as wide as its widest round
                depth = max((len(r.slots) for r in result.rounds), default=1)
                widest = max(r.drafted for r in result.rounds)
                why = explain_divergence(pair.target, ids, base.tokens, result.tokens, depth, widest)
                near_ties += why["near_tie"]
            tokens, rounds = tokens + len(result.tokens), rounds + len(result.rounds)
            drafted += result.drafted
            spec_s, plain_s = spec_s + result.decode_s, plain_s + base.decode_s
            row = {"shape": shape_text, "id": prompt["id"], "tokens": len(result.tokens),
                   "rounds": len(result.rounds), "decode_s": result.decode_s, "plain_decode_s": base.decode_s,
                   "identical": same}
            # every round: nodes, kept, draft / verify / total seconds, draft forwards, tokens verified
            row["round_detail"] = [[r.drafted, r.accepted, r.draft_s, r.verify_s, r.total_s, list(r.forwards),
                                    r.verified] for r in result.rounds]
            if isinstance(k, TreePolicy):  # what it chose and what that cost, to see why
                row["policy"] = k.snapshot()
            results.add(row)
        guess = by_shape.get(shape_text, {"tokens_per_forward": nan, "predicted_speedup": nan,
                                          "forwards_only_speedup": nan})
        measured.append({
            "shape": shape_text, "nodes": nodes_of(setting) if isinstance(setting, tuple) else drafted / rounds,
            "depth": len(setting) if isinstance(setting, tuple) else args.max_depth,
            "tokens_per_forward": tokens / rounds, "predicted_tokens_per_forward": guess["tokens_per_forward"],
            "speedup": plain_s / spec_s, "predicted_speedup": guess["predicted_speedup"],
            "prediction_error": guess["predicted_speedup"] / (plain_s / spec_s) - 1,
            "forwards_only_error": guess["forwards_only_speedup"] / (plain_s / spec_s) - 1,
            "spec_tok_s": tokens / spec_s, "identical": f"{identical}/{len(prompts)}",
            "parted": len(prompts) - identical, "near_ties": near_ties,
        })
    chain4 = measured[0]
    for row in measured:
        row["tokens_per_forward_vs_chain4"] = row["tokens_per_forward"] / chain4["tokens_per_forward"]
        row["speed_vs_chain4"] = row["speedup"] / chain4["speedup"]

    print(f"\n{pair.name}, {pair.device} {dtype_name(pair.dtype)}: {len(prompts)} {args.prompts} prompts x {n} tokens; "
          f"target step {step * 1e3:.1f} ms; draft forward of 1/2/4 tokens = "
          + "/".join(f"{draft_cost[w]:.3f}" for w in (1, 2, 4) if w in draft_cost) + " target steps; the draft's "
          "rank of the target's token: " + ", ".join(f"r{i} {p:.2f}" for i, p in enumerate(rank_probs))
          + f"; beyond the timed forwards (target steps): a plain token {host['plain_s'] / step:+.3f}, a round "
          f"{host['round_s'] / step:+.3f}, a tree round {host['tree_s'] / step:+.3f} more and "
          f"{host['masked_forward_s'] / step:+.3f} a draft forward under its mask (fitted to {host['rounds']} rounds "
          f"of {' / '.join(host['shapes'])})")
    print("\npredicted (replayed ranks), the best 8 by speed:")
    print(table(sorted(predicted, key=lambda p: -p["predicted_speedup"])[:8],
                [("shape", "s"), ("nodes", "d"), ("tokens_per_forward", ".2f"), ("cost_steps", ".2f"),
                 ("host_steps", ".2f"), ("forwards_only_speedup", ".2f"), ("predicted_speedup", ".2f")]))
    print("\nmeasured (the first row is the chain at K = 4):")
    print(table(measured, [("shape", "s"), ("nodes", ".1f"), ("tokens_per_forward", ".2f"),
                           ("predicted_tokens_per_forward", ".2f"), ("tokens_per_forward_vs_chain4", ".2f"),
                           ("speedup", ".2f"), ("predicted_speedup", ".2f"), ("prediction_error", "+.1%"),
                           ("forwards_only_error", "+.1%"),
                           ("identical", "s"), ("near_ties", "d")]))
    if summary := parting_summary(measured):
        print(summary)
    result = {"task": "tree_sweep", "pair": pair.name, "device": str(pair.device), "dtype": dtype_name(pair.dtype),
              **pair.setup_fields(),
              "args": {**vars(args), "trees": [describe(t) for t in args.trees]},
              "target_step_s": step, "draft_cost": draft_cost, "verify": verify, "verify_chain": verify_chain,
              "host": host,
              "rank_probs": rank_probs,
              "predicted": predicted, "measured": measured}
    path = results.finish(result)
    plots.tree_sweep(result, path.with_suffix(".png"))
    print(f"saved {path} and {path.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
