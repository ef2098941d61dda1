"""Progress and status lines for the terminal, on stderr so that tables and JSON on stdout stay clean."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

QUIET = False


def info(message: str) -> None:
    if not QUIET:
        print(f"[spark-spec] {message}", file=sys.stderr, flush=True)


def bar(**kwargs) -> tqdm:
    """A tqdm progress bar on stderr (hidden when quiet); bytes are shown scaled."""
    if kwargs.get("unit") == "B":
        kwargs.setdefault("unit_scale", True)
        kwargs.setdefault("unit_divisor", 1024)
    return tqdm(file=sys.stderr, disable=QUIET, leave=False, dynamic_ncols=True, **kwargs)
