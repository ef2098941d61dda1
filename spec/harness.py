"""The one measuring harness of the tasks and the sweep: plain decoding vs speculation (vs transformers), same
prompts, same run, same token counter.

`run_loop` and `hf_generate` are the two things measured; `timed` reads the clock around either with the device
drained. `run_prompt` / `run_set` are the side-by-side comparison the task scripts print: every number there is
generated tokens (counted from ids) over the wall time of the whole call, prefill included, so our loop and
transformers' `generate` are measured alike. The sweep builds its raw rows from the same two calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from spec import log
from spec.drafters import make_drafter
from spec.io import Results, table
from spec.loop import KPolicy, Result, generate
from spec.models import Model, Pair, chat_ids, sync_time
from spec.policy import TreePolicy
from spec.tree import Dynamic, chain, layout, most_nodes
from spec.warps import Sampling


@dataclass
class Setup:
    method: str = "draft"  # draft, lookup or none
    k: int | Callable[[], KPolicy] = 4  # a fixed K, or a factory of an adaptive policy (`--k auto`)
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 0
    compare_hf: bool = False
    tree: tuple[int, ...] | Dynamic | None = None  # a static shape or a dynamic tree (spec/tree.py), None: chains


def timed(fn, device):
    """(result, seconds) of fn(), with the device drained before both clock reads."""
    start = sync_time(device)
    out = fn()
    return out, sync_time(device) - start


def copy_bandwidth(device: torch.device, megabytes: int = 1024, reps: int = 1, trials: int = 5) -> float:
    """Device memory bandwidth in bytes/s from a large tensor copy (bytes read + bytes written): the best of
    `trials`, each `reps` back-to-back copies (several reps hide a GPU's launch gaps)."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(trials):
        start = sync_time(device)
        for _ in range(reps):
            dst.copy_(src)
        best = min(best, (sync_time(device) - start) / reps)
    return 2 * src.numel() / best


def forward_times(model: Model, context: list[int], new: list[int], trials: int, warmup: int = 1,
                  as_tree: bool = False) -> list[float]:
    """Seconds per forward of `new` on top of the cached `context`, rolled back after each trial. `as_tree`: read
    as a token tree's verify reads its nodes (a chain-shaped tree mask), the way a tree round's target forward runs
    (the graph backend sends a plain forward of more than 16 tokens through the layer stack, a tree's through its
    fused kernels)."""
    model.reset()
    model.forward(context, keep=1)
    mask = layout(chain(len(new)), 0, len(new), len(context), model.device) if as_tree else None
    times = []
    for i in range(warmup + trials):
        start = sync_time(model.device)
        model.forward(new, tree=mask) if as_tree else model.forward(new)
        elapsed = sync_time(model.device) - start
        model.rollback(len(context))
        if i >= warmup:
            times.append(elapsed)
    return times


class _AssistantConfigWarning(logging.Filter):
    """transformers' assisted generation calls the assistant's `generate` with a generation config and loose
    arguments together, then warns about it (once per process in 5.2x, on every call in 5.17). Nothing we pass
    causes it, and it would bury real warnings, so this one line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing `generation_config` together with generation-related" not in record.getMessage()


logging.getLogger("transformers.generation.utils").addFilter(_AssistantConfigWarning())


def run_loop(pair: Pair, method: str, k: int | KPolicy, ids: list[int], max_new_tokens: int,
             sampling: Sampling = Sampling(), seed: int = 0, tree: tuple[int, ...] | Dynamic | None = None) -> Result:
    """One generation by our loop: `method` draft, lookup or none (plain decoding), a seeded generator; `tree`
    drafts token trees of that shape, or dynamic trees (spec/tree.py)."""
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    return generate(pair.target, make_drafter(method, pair, shape=tree), ids, max_new_tokens, k=k, sampling=sampling,
                    generator=generator, eos=pair.eos, seed=seed)


def hf_generate(pair: Pair, ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                assist: str | None = None, k: int = 4) -> list[int]:
    """transformers' own generate, new ids only: plain (`assist` None), assisted by the draft model (`draft`), or
    by prompt lookup with K tokens (`lookup`)."""
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pair.tokenizer.pad_token_id or 0,
                  eos_token_id=sorted(pair.eos) or None)
    if sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                      top_k=sampling.top_k or None)
    if assist == "lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    elif assist == "draft":
        kwargs["assistant_model"] = pair.draft.model
    with torch.inference_mode():
        out = pair.target.model.generate(torch.tensor([ids], device=pair.device), **kwargs)
    return out[0, len(ids):].tolist()


def run_prompt(pair: Pair, prompt: dict, setup: Setup, k: int | KPolicy) -> dict:
    """One prompt: plain decoding (our loop, K = 0), speculation with `k`, and optionally transformers' generate."""
    ids = chat_ids(pair.tokenizer, prompt["prompt"])
    n = setup.max_new_tokens
    plain, plain_s = timed(lambda: run_loop(pair, "none", 0, ids, n, setup.sampling, setup.seed), pair.device)
    spec, spec_s = timed(lambda: run_loop(pair, setup.method, k, ids, n, setup.sampling, setup.seed, setup.tree),
                         pair.device)
    row = {
        "id": prompt["id"], "prompt_tokens": len(ids), "tokens": len(spec.tokens), "plain_tokens": len(plain.tokens),
        "alpha": spec.alpha, "tokens_per_round": spec.tokens_per_round,
        "plain_s": plain_s, "spec_s": spec_s, "plain_tok_s": len(plain.tokens) / plain_s,
        "spec_tok_s": len(spec.tokens) / spec_s, "spec": spec.summary(), "plain": plain.summary(),
        "spec_tokens": spec.tokens, "text": pair.tokenizer.decode(spec.tokens, skip_special_tokens=True),
    }
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    if setup.sampling.greedy or setup.sampling.coupled:  # else no sampled text is expected to match plain's
        row["identical"] = spec.tokens == plain.tokens
    if setup.sampling.greedy and not row["identical"]:
        row["divergence"] = explain_divergence(pair.target, ids, plain.tokens, spec.tokens,
                                               setup.k if isinstance(setup.k, int) else 4,
                                               max((r.drafted for r in spec.rounds), default=0)
                                               if setup.tree or isinstance(k, TreePolicy) else 0)
    if setup.compare_hf:
        assist = "lookup" if setup.method == "lookup" else "draft"
        k_hf = setup.k if isinstance(setup.k, int) else 4
        hf_plain, hf_plain_s = timed(lambda: hf_generate(pair, ids, n, setup.sampling), pair.device)
        hf_assisted, hf_assisted_s = timed(lambda: hf_generate(pair, ids, n, setup.sampling, assist, k_hf),
                                           pair.device)
        row.update(
            hf_plain_tokens=len(hf_plain), hf_plain_s=hf_plain_s, hf_plain_tok_s=len(hf_plain) / hf_plain_s,
            hf_assisted_tokens=len(hf_assisted), hf_assisted_s=hf_assisted_s,
            hf_assisted_tok_s=len(hf_assisted) / hf_assisted_s,
        )
        if setup.sampling.greedy:
            row["hf_plain_identical"] = hf_plain == plain.tokens
            row["hf_assisted_identical"] = hf_assisted == plain.tokens
    return row


def explain_divergence(target: Model, prompt: list[int], plain: list[int], spec: list[int], k: int,
                       nodes: int = 0) -> dict:
    """Where a greedy speculative run parted from plain decoding, and whether that is a numerical near-tie.

    In bf16 a 1-token step and a K+1-token verify reach the same position through differently shaped matrix
    products, which round differently; where the target's top two logits are closer than that rounding error, either
    token is the target's greedy choice up to rounding. This measures both at the first divergence: the top-2 gap of
    the target's 1-token-step logits there, and the largest logit difference between 1-token steps and one (K+1)-token
    forward over the same positions. The two runs also reached that position through different histories: plain
    decoding wrote every earlier position's keys and values in 1-token steps, speculation in (K+1)-token verifies, and
    those round differently too. So the generated text before it is also fed both ways from the prompt on, one token
    a forward and K+1 a forward, and the difference of the two logit rows there counts as well (`history_error`; the
    gap is the one-token history's, plain decoding's own). `near_tie` = gap <= error; a divergence that is no
    near-tie is a bug.

    A token tree's verify is another shape again (its forward is `nodes` + 1 tokens wide, and masked): where that is
    wider than the chain-shaped check, the same positions are also read from a tree forward whose path is the true
    text, with siblings hung off its first node up to that width, and the error is the larger of the two shapes'
    (`tree_error` alone)."""
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    text = list(prompt) + plain[:first]
    width = max(1, min(k + 1, len(text) - 1))
    target.reset()
    target.forward(text[:-width], keep=1)
    steps = torch.cat([target.forward(text[i : i + 1]) for i in range(len(text) - width, len(text))])
    target.rollback(len(text) - width)
    verify = target.forward(text[-width:])
    error = float((steps - verify).abs().max())
    out = {"first_divergence": first, "plain_token": plain[first] if first < len(plain) else None,
           "spec_token": spec[first] if first < len(spec) else None}

    def history(chunk: int) -> torch.Tensor:
        """The logits at the divergence after the prompt and then the generated text `chunk` tokens a forward."""
        target.reset()
        row = target.forward(list(prompt), keep=1)
        for i in range(0, first, chunk):
            row = target.forward(plain[i : min(i + chunk, first)], keep=1)
        return row[-1].float()

    one, chunked = history(1), history(k + 1)
    top = one.topk(2).values
    out["top2_gap"] = gap = float(top[0] - top[1])
    out["history_error"] = float((one - chunked).abs().max())
    out["shape_error"] = error = max(error, out["history_error"])
    if nodes + 1 > width >= 2:
        target.reset()
        target.forward(text[:-width], keep=1)
        tokens, parents, path = tree_around(text[-width:], nodes + 1, target.vocab)
        tree_rows = target.forward(tokens, tree=layout(parents, 0, len(tokens), len(text) - width, steps.device))
        out["tree_error"] = float((steps - tree_rows[path]).abs().max())
        out["shape_error"] = error = max(error, out["tree_error"])
    target.reset()
    return {**out, "near_tie": gap <= error}


def tree_around(path: list[int], size: int, vocab: int) -> tuple[list[int], tuple[int, ...], list[int]]:
    """A token tree of `size` nodes (>= len(path) >= 2) whose first branch is `path` and whose other nodes are
    siblings of path[1] (other tokens): (tokens, parents, the path's nodes in order). Every parent comes before its
    children, as in the loop's verify."""
    extra = [(path[1] + i) % vocab for i in range(1, size - len(path) + 1)]
    tokens = path[:2] + extra + path[2:]
    rest = list(range(2 + len(extra), len(tokens)))  # path[2:]'s nodes
    parents = [-1, 0] + [0] * len(extra) + ([1] + rest)[: len(rest)]  # path[2] under path[1], then a chain
    return tokens, tuple(parents), [0, 1] + rest


def k_label(k) -> str:
    """How a K setting prints: the number, "auto" for adaptive K, "auto-tree" for the tree policy."""
    if isinstance(k, int):
        return str(k)
    return "auto-tree" if isinstance(k, TreePolicy) or getattr(k, "func", None) is TreePolicy else "auto"


def make_k(setup: Setup) -> int | KPolicy:
    return setup.k() if callable(setup.k) else setup.k


def warm_up(pair: Pair, setup: Setup, context: int) -> None:
    """Ready the models for texts of up to `context` tokens (the graph backend captures its graphs), then one
    short generation of each kind; none of it is measured."""
    k = make_k(setup)
    pair.prepare(k if isinstance(k, int) else k.max_k, context, most_nodes(setup.tree) or most_nodes(k))
    short = replace(setup, max_new_tokens=min(8, setup.max_new_tokens))
    run_prompt(pair, {"id": "warm-up", "prompt": "Hello"}, short, make_k(setup))


def run_set(pair: Pair, prompts: list[dict], setup: Setup, desc: str = "prompts", results: Results | None = None,
            tag: dict | None = None) -> tuple[list[dict], dict]:
    """Warm up, run every prompt, and total the set (tokens over summed seconds, not a mean of ratios). Each
    prompt's row goes to `results` (with the fields of `tag`) as soon as it is done."""
    longest = max(len(chat_ids(pair.tokenizer, p["prompt"])) for p in prompts)
    warm_up(pair, setup, longest + setup.max_new_tokens)
    k = make_k(setup)  # one adaptive policy learns across the whole set, as it would across a server's requests
    rows = []
    with log.bar(total=len(prompts), desc=desc) as bar:
        for prompt in prompts:
            rows.append(run_prompt(pair, prompt, setup, k))
            if results:
                results.add({**(tag or {}), **rows[-1]})
            bar.update()
    return rows, total_of(rows, setup.compare_hf)


def total_of(rows: list[dict], compare_hf: bool) -> dict:
    """The set's totals from its rows."""
    total = {
        "id": "ALL", "prompt_tokens": sum(r["prompt_tokens"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
        "near_ties": sum(1 for r in rows if r.get("divergence", {}).get("near_tie")),
        "divergences": sum(1 for r in rows if "divergence" in r),
        "alpha": ratio(sum(r["spec"]["accepted"] for r in rows), sum(r["spec"]["drafted"] for r in rows)),
        "tokens_per_round": ratio(sum(r["tokens"] for r in rows), sum(r["spec"]["rounds"] for r in rows)),
        "plain_tok_s": ratio(sum(r["plain_tokens"] for r in rows), sum(r["plain_s"] for r in rows)),
        "spec_tok_s": ratio(sum(r["tokens"] for r in rows), sum(r["spec_s"] for r in rows)),
    }
    total["speedup"] = ratio(total["spec_tok_s"], total["plain_tok_s"])
    if rows and all("identical" in r for r in rows):
        total["identical"] = all(r["identical"] for r in rows)
    if compare_hf:
        for kind in ("hf_plain", "hf_assisted"):
            total[f"{kind}_tok_s"] = ratio(sum(r[f"{kind}_tokens"] for r in rows), sum(r[f"{kind}_s"] for r in rows))
        total["hf_assisted_speedup"] = ratio(total["hf_assisted_tok_s"], total["plain_tok_s"])
        total["ours_vs_hf_assisted"] = ratio(total["spec_tok_s"], total["hf_assisted_tok_s"])
    return total


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_rows(rows: list[dict], total: dict, compare_hf: bool) -> None:
    columns = [("id", "s"), ("tokens", "d"), ("identical", "s"), ("alpha", ".2f"), ("tokens_per_round", ".2f"),
               ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"), ("speedup", ".2f")]
    if compare_hf:
        columns += [("hf_plain_tok_s", ".2f"), ("hf_assisted_tok_s", ".2f")]
    print(table([*rows, total], [c for c in columns if c[0] in total]))
