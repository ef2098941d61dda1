"""Side-by-side runs shared by the task scripts: plain decoding vs speculation (vs transformers), same prompts,
same run, same token counter. Every number is generated tokens (counted from ids) over the wall time of the whole
call, prefill included, so our loop and transformers' `generate` are measured alike."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch

from spec import log
from spec.cli import table
from spec.common import Pair, chat_ids, sync_time
from spec.drafters import make_drafter
from spec.loop import KPolicy, Result, generate
from spec.policy import parse_k
from spec.rules import Sampling


@dataclass
class Setup:
    method: str = "draft"
    k: int | Callable[[], KPolicy] = 4  # a fixed K, or a factory of an adaptive policy (`--k auto`)
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 0
    compare_hf: bool = False


def add_run_args(parser: argparse.ArgumentParser, prompts: str, limit: int, max_new_tokens: int) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--prompts", default=prompts, help=f"prompt set in prompts/ or a .jsonl path (default {prompts})")
    g.add_argument("--limit", type=int, default=limit, help=f"use the first N prompts (default {limit}; 0 = all)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens to generate per prompt (default {max_new_tokens})")
    g.add_argument("--k", type=parse_k, default=4,
                   help="draft tokens per round: a number (default 4; 0 = plain decoding), or auto / auto:N for "
                        "adaptive K up to N (default 8), learned over the prompt set")


def timed(fn, device):
    """(result, seconds) of fn(), with the device drained before both clock reads."""
    start = sync_time(device)
    out = fn()
    return out, sync_time(device) - start


def hf_generate(pair: Pair, ids: list[int], setup: Setup, assisted: bool) -> list[int]:
    """transformers' own generate, new ids only: plain, or assisted — `assistant_model=` the draft, or
    `prompt_lookup_num_tokens=K` for the lookup method."""
    kwargs = dict(max_new_tokens=setup.max_new_tokens, pad_token_id=pair.tokenizer.pad_token_id or 0,
                  eos_token_id=sorted(pair.eos) or None)
    if setup.sampling.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=setup.sampling.temperature, top_p=setup.sampling.top_p,
                      top_k=setup.sampling.top_k or None)
    if assisted and setup.method == "lookup":
        kwargs["prompt_lookup_num_tokens"] = setup.k
    elif assisted:
        kwargs["assistant_model"] = pair.draft.model
    with torch.inference_mode():
        out = pair.target.model.generate(torch.tensor([ids], device=pair.device), **kwargs)
    return out[0, len(ids):].tolist()


def run_prompt(pair: Pair, prompt: dict, setup: Setup, k: int | KPolicy) -> dict:
    """One prompt: plain decoding (our loop, K = 0), speculation with `k`, and optionally transformers' generate."""
    ids = chat_ids(pair.tokenizer, prompt["prompt"])

    def ours(method: str, k: int | KPolicy) -> Result:
        generator = torch.Generator(device=pair.device).manual_seed(setup.seed)
        drafter = make_drafter(method, pair)
        return generate(pair.target, drafter, ids, setup.max_new_tokens, k=k, sampling=setup.sampling,
                        generator=generator, eos=pair.eos)

    plain, plain_s = timed(lambda: ours("none", 0), pair.device)
    spec, spec_s = timed(lambda: ours(setup.method, k), pair.device)
    row = {
        "id": prompt["id"], "prompt_tokens": len(ids), "tokens": len(spec.tokens), "plain_tokens": len(plain.tokens),
        "identical": spec.tokens == plain.tokens, "alpha": spec.alpha, "tokens_per_round": spec.tokens_per_round,
        "plain_s": plain_s, "spec_s": spec_s, "plain_tok_s": len(plain.tokens) / plain_s,
        "spec_tok_s": len(spec.tokens) / spec_s, "spec": spec.summary(), "plain": plain.summary(),
        "spec_tokens": spec.tokens, "text": pair.tokenizer.decode(spec.tokens, skip_special_tokens=True),
    }
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    if setup.sampling.greedy and not row["identical"]:
        row["divergence"] = explain_divergence(pair.target, ids, plain.tokens, spec.tokens,
                                               setup.k if isinstance(setup.k, int) else 4)
    if setup.compare_hf:
        hf_plain, hf_plain_s = timed(lambda: hf_generate(pair, ids, setup, assisted=False), pair.device)
        hf_assisted, hf_assisted_s = timed(lambda: hf_generate(pair, ids, setup, assisted=True), pair.device)
        row.update(
            hf_plain_tokens=len(hf_plain), hf_plain_s=hf_plain_s, hf_plain_tok_s=len(hf_plain) / hf_plain_s,
            hf_assisted_tokens=len(hf_assisted), hf_assisted_s=hf_assisted_s,
            hf_assisted_tok_s=len(hf_assisted) / hf_assisted_s,
        )
        if setup.sampling.greedy:
            row["hf_plain_identical"] = hf_plain == plain.tokens
            row["hf_assisted_identical"] = hf_assisted == plain.tokens
    return row


def explain_divergence(target, prompt: list[int], plain: list[int], spec: list[int], k: int) -> dict:
    """Where a greedy speculative run parted from plain decoding, and whether that is a numerical near-tie.

    In bf16 a 1-token step and a K+1-token verify reach the same position through differently shaped matrix
    products, which round differently; where the target's top two logits are closer than that rounding error, either
    token is the target's greedy choice up to rounding. This measures both at the first divergence: the top-2 gap of
    the target's 1-token-step logits there, and the largest logit difference between 1-token steps and one (K+1)-token
    forward over the same positions. `near_tie` = gap <= error; a divergence that is no near-tie is a bug."""
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    text = list(prompt) + plain[:first]
    width = max(1, min(k + 1, len(text) - 1))
    target.reset()
    target.forward(text[:-width], keep=1)
    steps = torch.cat([target.forward(text[i : i + 1]) for i in range(len(text) - width, len(text))])
    target.rollback(len(text) - width)
    verify = target.forward(text[-width:])
    target.reset()
    top = steps[-1].float().topk(2).values
    gap, error = float(top[0] - top[1]), float((steps - verify).abs().max())
    return {"first_divergence": first, "plain_token": plain[first] if first < len(plain) else None,
            "spec_token": spec[first] if first < len(spec) else None, "top2_gap": gap, "shape_error": error,
            "near_tie": gap <= error}


def k_label(k) -> str:
    """How a K setting prints: the number, or "auto" for an adaptive policy."""
    return str(k) if isinstance(k, int) else "auto"


def make_k(setup: Setup) -> int | KPolicy:
    return setup.k() if callable(setup.k) else setup.k


def warm_up(pair: Pair, setup: Setup) -> None:
    """One short generation of each kind, excluded from every measurement (first-call allocations, lazy init)."""
    short = Setup(setup.method, setup.k, min(8, setup.max_new_tokens), setup.sampling, setup.seed, setup.compare_hf)
    run_prompt(pair, {"id": "warm-up", "prompt": "Hello"}, short, make_k(setup))


def run_set(pair: Pair, prompts: list[dict], setup: Setup, desc: str = "prompts") -> tuple[list[dict], dict]:
    """Warm up, run every prompt, and total the set (tokens over summed seconds, not a mean of ratios)."""
    warm_up(pair, setup)
    k = make_k(setup)  # one adaptive policy learns across the whole set, as it would across a server's requests
    rows = []
    with log.bar(total=len(prompts), desc=desc) as bar:
        for prompt in prompts:
            rows.append(run_prompt(pair, prompt, setup, k))
            bar.update()
    total = {
        "id": "ALL", "prompt_tokens": sum(r["prompt_tokens"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
        "identical": all(r["identical"] for r in rows),
        "near_ties": sum(1 for r in rows if r.get("divergence", {}).get("near_tie")),
        "divergences": sum(1 for r in rows if "divergence" in r),
        "alpha": _ratio(sum(r["spec"]["kept"] for r in rows), sum(r["spec"]["drafted"] for r in rows)),
        "tokens_per_round": _ratio(sum(r["tokens"] for r in rows), sum(r["spec"]["rounds"] for r in rows)),
        "plain_tok_s": _ratio(sum(r["plain_tokens"] for r in rows), sum(r["plain_s"] for r in rows)),
        "spec_tok_s": _ratio(sum(r["tokens"] for r in rows), sum(r["spec_s"] for r in rows)),
    }
    total["speedup"] = _ratio(total["spec_tok_s"], total["plain_tok_s"])
    if setup.compare_hf:
        for kind in ("hf_plain", "hf_assisted"):
            total[f"{kind}_tok_s"] = _ratio(sum(r[f"{kind}_tokens"] for r in rows), sum(r[f"{kind}_s"] for r in rows))
        total["hf_assisted_speedup"] = _ratio(total["hf_assisted_tok_s"], total["plain_tok_s"])
        total["ours_vs_hf_assisted"] = _ratio(total["spec_tok_s"], total["hf_assisted_tok_s"])
    return rows, total


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def print_rows(rows: list[dict], total: dict, compare_hf: bool) -> None:
    columns = [("id", "s"), ("tokens", "d"), ("identical", "s"), ("alpha", ".2f"), ("tokens_per_round", ".2f"),
               ("plain_tok_s", ".2f"), ("spec_tok_s", ".2f"), ("speedup", ".2f")]
    if compare_hf:
        columns += [("hf_plain_tok_s", ".2f"), ("hf_assisted_tok_s", ".2f")]
    print(table([*rows, total], [c for c in columns if c[0] in total]))
