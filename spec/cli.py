"""What every task's command line shares: the model flags, prompt sets, and where results are written."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from spec import log
from spec.common import PAIR_CHOICES, PAIRS, ModelError, Pair, load_pair

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
RESULTS_DIR = Path("results")


def add_model_args(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    pairs = "; ".join(f"{name}: {spec.about}" for name, spec in PAIRS.items())
    g = parser.add_argument_group("models")
    g.add_argument("--pair", default="auto", choices=PAIR_CHOICES,
                   help=f"model pair (default auto: llama if cached locally, else qwen-coder). {pairs}")
    g.add_argument("--target", help="override the target: hub id, local folder, or .gguf path")
    if draft:
        g.add_argument("--draft", help="override the draft: hub id, local folder, or .gguf path")
        g.add_argument("--allow-other-family", action="store_true",
                       help="accept a draft whose tokenizer differs (ids are remapped; an experiment, not a speedup)")
    g.add_argument("--device", help="cuda, mps or cpu (default: the first available in that order)")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="default bfloat16 (float16 on mps; the tiny pair uses float32)")
    g.add_argument("--backend", default="auto", choices=["auto", "eager", "graph"],
                   help="eager: transformers forward + DynamicCache (everywhere); graph: static KV cache + CUDA graphs "
                        "(CUDA, Llama/Qwen2); auto (default): graph where it can run, else eager")
    g.add_argument("--quiet", action="store_true", help="no progress bars or status lines")


def load_from_args(args: argparse.Namespace, with_draft: bool = True) -> Pair:
    """Load the pair the flags name; model errors end the program with their message, not a traceback."""
    log.QUIET = getattr(args, "quiet", False)
    try:
        return load_pair(
            args.pair, target=args.target, draft=getattr(args, "draft", None), device=args.device, dtype=args.dtype,
            with_draft=with_draft, allow_other_family=getattr(args, "allow_other_family", False),
            backend=args.backend,
        )
    except ModelError as err:
        sys.exit(f"error: {err}")


def load_prompts(name: str) -> list[dict]:
    """A prompt set: a name in prompts/ (e.g. `short`) or a path to a .jsonl file of {"id", "prompt"} rows."""
    path = Path(name)
    if not path.suffix:
        path = PROMPTS_DIR / f"{name}.jsonl"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl")))
        raise SystemExit(f"error: no prompt set {name!r} (known: {known}, or a path to a .jsonl file)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append({"id": str(row.get("id", number)), "prompt": str(row["prompt"])})
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise SystemExit(f"error: {path}:{number}: each line must be a JSON object with a 'prompt' ({err})")
    if not rows:
        raise SystemExit(f"error: {path} holds no prompts")
    return rows


def save_json(task: str, data: dict, out_dir: Path | None = None) -> Path:
    """Write `results/<task>-<UTC time>.json` (and `<task>-latest.json`); return the path."""
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"{task}-{stamp}.json"
    text = json.dumps(data, indent=2, default=str)
    path.write_text(text)
    (out_dir / f"{task}-latest.json").write_text(text)
    return path


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: columns are (key, format) pairs, e.g. ("tok_s", ".2f")."""
    head = [key for key, _ in columns]
    body = [[_cell(row.get(key), fmt) for key, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])


def _cell(value, fmt: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)
