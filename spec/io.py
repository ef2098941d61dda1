"""Files and tables, shared by the tasks and the benchmark client. Imports no torch: `bench.py` is a pure client.

- prompt sets: `prompts/<name>.jsonl` (or any .jsonl path) of {"id", "prompt"} rows;
- results: `results/<task>-<UTC time>.jsonl`, one row per prompt (or measurement) written as it finishes, so that a
  run cut short keeps every finished row; then `results/<task>-<UTC time>.json`, assembled from those rows, plus
  `<task>-latest.json`;
- plain-text tables whose columns are (key, format) pairs.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"
RESULTS_DIR = Path("results")


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
            message = f"error: {path}:{number}: each line must be a JSON object with a 'prompt' ({err})"
            raise SystemExit(message) from None
    if not rows:
        raise SystemExit(f"error: {path} holds no prompts")
    return rows


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def save_json(task: str, data: dict, out_dir: Path | None = None, stamp: str | None = None) -> Path:
    """Write `results/<task>-<UTC time>.json` (and `<task>-latest.json`); return the path."""
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{task}-{stamp or _stamp()}.json"
    text = json.dumps(data, indent=2, default=str)
    path.write_text(text)
    (out_dir / f"{task}-latest.json").write_text(text)
    return path


class Results:
    """A task's results as they come: `add(row)` appends one JSON line to `results/<task>-<time>.jsonl` and flushes
    it at once; `finish(data)` writes the task's JSON beside it, with `data[key]` = the rows read back from that
    file. A run killed half way keeps the JSONL of every row it finished."""

    def __init__(self, task: str, out_dir: Path | None = None):
        self.task, self.out_dir = task, out_dir or RESULTS_DIR
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stamp, again = _stamp(), 1
        self.stamp = stamp
        while (self.out_dir / f"{task}-{self.stamp}.jsonl").exists():  # two runs in one second
            again += 1
            self.stamp = f"{stamp}-{again}"
        self.path = self.out_dir / f"{task}-{self.stamp}.jsonl"
        self.path.touch()

    def add(self, row: dict) -> dict:
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def finish(self, data: dict, key: str | None = "rows") -> Path:
        if key:
            data = {**data, key: self.rows()}
        return save_json(self.task, data, self.out_dir, self.stamp)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: columns are (key, format) pairs, e.g. ("tok_s", ".2f"). None prints as a dash."""
    head = [key for key, _ in columns]
    body = [[cell(row.get(key), fmt) for key, fmt in columns] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])


def cell(value, fmt: str) -> str:
    """One table cell: None as a dash, booleans as yes / NO, numbers by `fmt`, anything else as text."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)
