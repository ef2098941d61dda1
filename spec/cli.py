"""What every task's command line shares: the model flags, the run flags, and loading the pair they name."""

from __future__ import annotations

import argparse
import functools
import sys

from spec import log, tree
from spec.io import load_prompts
from spec.models import BACKENDS, PAIR_CHOICES, PAIRS, ModelError, Pair, load_pair
from spec.models.quant import DRAFT_QUANTS, QUANTS
from spec.policy import TreePolicy, parse_k


def add_model_args(parser: argparse.ArgumentParser, draft: bool = True, auto_draft: bool = True) -> None:
    """The model flags. `auto_draft=False` (tools that measure the draft's own weights against the formats they
    name: bench_engine, tune_kernels): --draft-quant defaults to none and takes no auto."""
    pairs = "; ".join(f"{name}: {spec.about}" for name, spec in PAIRS.items())
    g = parser.add_argument_group("models")
    g.add_argument("--pair", default="auto", choices=PAIR_CHOICES,
                   help=f"model pair (default auto: llama if cached locally, else qwen-coder). {pairs}")
    g.add_argument("--target", help="override the target: hub id, local folder, or .gguf path")
    if draft:
        g.add_argument("--draft", help="override the draft: hub id, local folder, or .gguf path")
        auto = ("auto (default): the format measured fastest where the draft runs, int4 on a CPU, int8 in the graph "
                "backend's kernels on a GPU, else none. " if auto_draft else "Default none. ")
        g.add_argument("--draft-quant", default="auto" if auto_draft else "none",
                       choices=DRAFT_QUANTS if auto_draft else QUANTS,
                       help="the draft's weights: none (its dtype), int8 (a scale per row), int4 (a scale and offset "
                            "per 32 inputs) or fp8 (e4m3, a scale per row; GPUs that read fp8 only), weight-only; "
                            "w4a8: int4 weights whose one-token products take their inputs rounded to 8 bits a group "
                            "(CUDA's graph backend; a draft's only). "
                            + auto + "Any of them changes no answer, since the acceptance rule keeps the target's "
                            "distribution for any draft (docs/quantization.md)")
        g.add_argument("--allow-other-family", action="store_true",
                       help="accept a draft whose tokenizer differs (ids are remapped; an experiment, not a speedup)")
    g.add_argument("--target-quant", default="none", choices=QUANTS,
                   help="the target's weights, the same formats: CHANGES THE MODEL (off by default). Answers are "
                        "then the quantized target's, exactness is against it, and its greedy agreement and mean "
                        "KL against the unquantized target are measured at load and reported (docs/quantization.md)")
    g.add_argument("--device", help="cuda, mps or cpu (default: the first available in that order)")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 (float16 on mps; the tiny pair uses float32)")
    g.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="eager: transformers forward + DynamicCache (everywhere); graph: static KV cache, with CUDA "
                        "graphs on a GPU (CUDA or CPU, Llama/Qwen2; on CUDA up to 4096 positions); auto "
                        "(default): graph where it can run, else eager")
    g.add_argument("--quiet", action="store_true", help="no progress bars or status lines")


def add_run_args(parser: argparse.ArgumentParser, prompts: str | None, limit: int, max_new_tokens: int,
                 k: int = 4) -> None:
    """--prompts (unless `prompts` is None: the task names its own sets), --limit, --max-new-tokens, --k."""
    g = parser.add_argument_group("run")
    if prompts is not None:
        g.add_argument("--prompts", default=prompts,
                       help=f"prompt set in prompts/ or a .jsonl path (default {prompts})")
    g.add_argument("--limit", type=int, default=limit, help=f"use the first N prompts (default {limit}; 0 = all)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens to generate per prompt (default {max_new_tokens})")
    g.add_argument("--k", type=parse_k, default=k,
                   help=f"draft tokens per round: a number (default {k}; 0 = plain decoding), or auto / auto:N for "
                        "adaptive K up to N (default 8), learned over the prompt set")
    add_tree_arg(g)


def add_tree_arg(group) -> None:
    group.add_argument("--tree", type=tree.parse_tree, default=None, metavar="B1,B2,...|dynamic:N[:W]|auto[:N]",
                       help=TREE_HELP)


TREE_HELP = ("a token tree instead of a chain (docs/trees.md). B1,B2,...: a static shape, the "
             "branching per depth, e.g. 3,2,1 (3 children of the root, 2 of each, 1 of each: 15 nodes, 3 deep; at "
             "most K deep and 64 nodes); with prompt lookup its first number is the number of earlier matches "
             "offered as branches. dynamic:N[:W]: EAGLE-2's dynamic tree, the N nodes of highest draft path "
             "probability, at most K deep, W (default min(4, N)) nodes expanded per draft forward, each offering W "
             "children. auto[:N]: a policy picks each round the static shape of at most N nodes (default 16) with "
             "the best predicted tokens per second from the acceptance and forward times it measures, the chain "
             "or plain decoding when trees do not pay; at most --k deep (--k auto: 8). Not with prompt lookup")


def resolve_tree(parser: argparse.ArgumentParser, args: argparse.Namespace, method: str = "draft") -> None:
    """After parsing, before anything loads: --tree auto becomes the K setting (a factory of TreePolicy, at most
    --k deep) and no fixed tree; static and dynamic trees need a fixed --k (the tree is at most K deep); a dynamic
    tree or the policy needs the draft model."""
    setting = getattr(args, "tree", None)
    if setting is None:
        return
    if isinstance(setting, (tree.Dynamic, tree.Auto)) and method != "draft":
        parser.error(f"--tree {tree.describe(setting)} grows trees from the draft model's probabilities: use "
                     "--method draft, or --tree B (B earlier matches as branches) with prompt lookup")
    if isinstance(setting, tree.Auto):
        max_depth = args.k if isinstance(args.k, int) else args.k.keywords.get("max_k", 8)
        if max_depth < 1:
            parser.error("--tree auto needs --k >= 1 or auto (its largest depth)")
        args.k = functools.partial(TreePolicy, max_depth=max_depth, max_nodes=setting.max_nodes)
        args.tree = None
    elif not isinstance(args.k, int):
        parser.error("--tree needs a fixed --k (the tree is at most K deep); --tree auto chooses trees by itself")


REPORT_PROMPTS, REPORT_LIMIT, REPORT_TOKENS = "short", 3, 32  # --target-quant's report where a task has no set


def load_from_args(args: argparse.Namespace, with_draft: bool = True, report_prompts: list[dict] | None = None,
                   report_tokens: int | None = None, reference=None) -> Pair:
    """Load the pair the flags name; model errors end the program with their message, not a traceback.

    With --target-quant, the quantized target is measured against the unquantized one on `report_prompts` (the
    task's own prompts, `report_tokens` each) or, for tasks without a prompt set (the server, check_pair), on
    the first REPORT_LIMIT `short` prompts x REPORT_TOKENS tokens; `reference` reuses one measured earlier."""
    log.QUIET = getattr(args, "quiet", False)
    target_quant = getattr(args, "target_quant", "none")
    if target_quant != "none" and report_prompts is None and reference is None:
        report_prompts, report_tokens = load_prompts(REPORT_PROMPTS)[:REPORT_LIMIT], REPORT_TOKENS
    try:
        pair = load_pair(
            args.pair, target=args.target, draft=getattr(args, "draft", None), device=args.device, dtype=args.dtype,
            with_draft=with_draft, allow_other_family=getattr(args, "allow_other_family", False),
            backend=args.backend, draft_quant=getattr(args, "draft_quant", "none"), target_quant=target_quant,
            report_prompts=[p["prompt"] for p in report_prompts] if report_prompts else None,
            report_tokens=report_tokens or REPORT_TOKENS, reference=reference,
            context=getattr(args, "max_model_len", None),  # the server's --max-model-len sizes the caches
        )
    except ModelError as err:
        sys.exit(f"error: {err}")
    return pair
