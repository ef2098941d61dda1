"""The documentation cannot rot: every `python -m spec.` command shown in README.md and docs/*.md runs.

Commands are collected from the fenced shell blocks (```bash, ```sh, ```console or a bare ```) and run as
subprocesses, two at a time, each from an empty folder, on the tiny pair and shrunk with flags the task really has
(read from its own --help): `--pair X` becomes `--pair tiny` (added where the task takes model flags),
--device/--target/--draft are dropped (CI has a CPU and no hub), --limit 1, --max-new-tokens 8, --trials 2, ...
Server and bench.py lines are not `python -m spec.` commands and have their own tests. Also here: the numbers the
figures of docs/explained.md are drawn from.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
PREFIX = "python -m spec."

# Less work, same code paths. Applied only where the task's --help lists the flag; replaces the shown value.
SHRINK = {
    "--limit": "1", "--max-new-tokens": "8", "--trials": "2", "--reps": "1", "--context": "64", "--ns": "1,4",
    "--n": "2000", "--loop-n": "100", "--tokens": "8",
}
TASK_SHRINK = {
    "sweep": {"--k": "1,2"},  # a list of Ks here, one K elsewhere
    # Fewer loop runs than this and the loop-level Break-It bugs go uncaught (power 0.2 at 100): exit status 1.
    "dist_test": {"--loop-n": "300", "--warp-n": "200"},
    "bench_engine": {"--backends": "eager,static"},  # the graph backends need CUDA
}
DROP = {"--device", "--target", "--draft", "--backend"}  # flags taking one value that CI cannot honour
TIMEOUT_S = 240


# ---- collecting --------------------------------------------------------------------------------------------


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.is_file()]


def shown_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each `python -m spec.` command in a fenced shell block: a line, or a part of a
    line chained with `&&` (`pip install ... && python -m spec.x`); continuation lines joined, a `$ ` prompt
    removed."""
    found, fence, pending, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = stripped[3:].strip().lower() if fence is None else None
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = number
        pending += stripped.removeprefix("$ ")
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        found += [(start, part.strip()) for part in pending.split("&&") if part.strip().startswith(PREFIX)]
        pending = ""
    return found


@functools.cache
def task_flags(task: str) -> frozenset[str]:
    """The options a task accepts, read from the usage lines of its own --help (run in this process)."""
    module = importlib.import_module(f"spec.{task}")
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [f"spec.{task}", "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            module.main()
    finally:
        sys.argv = argv
    usage = out.getvalue().split("\n\n")[0]
    return frozenset(re.findall(r"(?<![\w-])--[a-z][\w-]*", usage))


def ci_argv(command: str) -> list[str]:
    """The argv that CI runs for a shown command: tiny pair, CPU, shrunk; shell comments and anything after a
    pipe or a `&&` dropped."""
    words = []
    for word in shlex.split(command, comments=True):
        if word in ("|", "||", "&&", ";", "&", ">", ">>"):
            break
        words.append(word)
    task = words[2].removeprefix("spec.")
    flags = task_flags(task)
    args = []
    for word in words[3:]:  # one flag and its value per item, so that values can be replaced or dropped
        if word.startswith("--") and "=" in word:
            args.extend([word.split("=", 1)[0], word.split("=", 1)[1]])
        else:
            args.append(word)
    items: list[list[str]] = []
    for word in args:
        if word.startswith("--") or not items:
            items.append([word])
        else:
            items[-1].append(word)
    wanted = {**SHRINK, **TASK_SHRINK.get(task, {})}
    if "--pair" in flags:
        wanted["--pair"] = "tiny"
    kept = [item for item in items if item[0] not in DROP]
    for flag, value in wanted.items():
        if flag not in flags:
            continue
        kept = [item for item in kept if item[0] != flag] + [[flag, value]]
    if "--quiet" in flags and ["--quiet"] not in kept:
        kept.append(["--quiet"])
    return [sys.executable, "-m", f"spec.{task}", *(word for item in kept for word in item)]


def collected() -> list:
    """One pytest param per distinct CI command, named by where it is shown."""
    params, seen = [], set()
    for path in doc_files():
        for number, command in shown_commands(path.read_text()):
            argv = tuple(ci_argv(command))
            if argv in seen:
                continue
            seen.add(argv)
            shown = shlex.join(shlex.split(command, comments=True)[2:])
            params.append(pytest.param(command, list(argv), id=f"{path.name}:{number} {shown}"))
    return params


# ---- running -------------------------------------------------------------------------------------------------


def run_command(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg",
           # The tiny pair's 64-wide layers gain nothing from threads; on a busy 2-core machine they cost ~10x.
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every selected command, submitted at once and run two at a time, each from its own empty folder: each uses
    one thread and CI has two cores, so the file takes half the time it would in turn."""
    pool = ThreadPoolExecutor(max_workers=2)
    runs = {}
    for item in request.session.items:
        argv = item.callspec.params.get("argv") if hasattr(item, "callspec") else None
        if argv and tuple(argv) not in runs:
            cwd = tmp_path_factory.mktemp("command")
            runs[tuple(argv)] = (pool.submit(run_command, argv, cwd), cwd)
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("shown, argv", collected())
def test_documented_command_runs(shown, argv, started):
    future, cwd = started[tuple(argv)]
    run = future.result()
    assert run.returncode == 0, (
        f"`{shown}` ran in CI as `{shlex.join(argv[1:])}` and exited {run.returncode}:\n"
        f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    if argv[2] == "spec.figures":
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path("docs/figures")
        for name in ("rule.png", "speedup_vs_k.png", "roofline.png"):
            written = cwd / out / name
            assert written.is_file() and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{written} not written"


# ---- the collector itself ------------------------------------------------------------------------------------


def test_commands_are_collected_from_shell_fences_only():
    text = "\n".join([
        "python -m spec.calc --alpha 0.1 --c 0.1",  # prose, not a fence
        "```bash",
        "python -m spec.spec_greedy --pair qwen-coder \\",
        "    --limit 6   # a comment",
        "python server_spec.py --pair llama",
        "$ python -m spec.calc --alpha 0.7 --c 0.1",
        "pip install -e . && python -m spec.check_pair",
        "```",
        "```python",
        "python -m spec.lookup",
        "```",
    ])
    assert shown_commands(text) == [(3, "python -m spec.spec_greedy --pair qwen-coder --limit 6   # a comment"),
                                    (6, "python -m spec.calc --alpha 0.7 --c 0.1"), (7, "python -m spec.check_pair")]


def test_commands_are_rewritten_to_the_tiny_pair_and_shrunk():
    argv = ci_argv("python -m spec.spec_greedy --pair qwen-coder --limit 6 --k 4 --compare-hf --device=cuda # x")
    flags = argv[3:]
    assert argv[1:3] == ["-m", "spec.spec_greedy"]
    assert flags[flags.index("--pair") + 1] == "tiny" and flags[flags.index("--limit") + 1] == "1"
    assert flags[flags.index("--k") + 1] == "4" and "--compare-hf" in flags
    assert "--device" not in flags and "cuda" not in flags and "qwen-coder" not in flags and "#" not in flags
    added = ci_argv("python -m spec.check_pair")
    assert added[added.index("--pair") + 1] == "tiny"  # added where the task takes it
    assert "--pair" not in ci_argv("python -m spec.calc --alpha 0.7 --c 0.1")  # and only there


def test_the_walkthrough_runs_every_task_it_explains():
    shown = {command.split()[2] for _, command in shown_commands((ROOT / "docs" / "explained.md").read_text())}
    assert {f"spec.{task}" for task in ("check_pair", "verify_cost", "spec_greedy", "spec_sample", "dist_test", "calc",
                                        "sweep", "lookup", "figures")} <= shown


# ---- the numbers behind the figures --------------------------------------------------------------------------


def test_the_rule_figure_lands_on_p_and_the_bug_does_not():
    from spec.figures import rule_numbers

    numbers = rule_numbers(samples=10_000, seed=0)
    p = np.array(numbers["p"])
    # float64: q + fl(p - q) (or p + 0), two roundings: <= 2^-52 = 2.2e-16 relative; rtol 1e-15
    # the stacked bars are p
    assert np.allclose(np.add(numbers["accepted"], numbers["residual"]), p, rtol=1e-15, atol=0)
    assert numbers["alpha"] == pytest.approx(0.7)  # float64 sum of 6 terms, ~1e-16: approx's default rel 1e-6 ample
    assert numbers["correct"]["p_value"] > 1e-3  # dist_test's LEVEL: a correct rule fails at 1 seed in 1000
    # Frequencies of 10^4 draws, all laws here <= 0.3: 5 s.e. = 5 sqrt(0.3 x 0.7 / 10^4) = 0.023 (6 x 6e-7 false fail)
    assert np.abs(np.array(numbers["correct"]["freq"]) - p).max() < 0.023
    # The bug's noncentrality n sum (law - p)^2 / p = 833 (df 5): 5 sigma below, 549, is still far past sf = 1e-20 (103)
    assert numbers["resample-p"]["p_value"] < 1e-20
    bug = np.array(numbers["resample-p"]["freq"])
    assert np.abs(bug - np.array(numbers["bug_law"])).max() < 0.023  # off from p exactly as predicted
    # The law predicts p - 0.11 and p + 0.06 there; 5 s.e. (0.0039, 0.0044) short of each: 0.09 and 0.038
    assert bug[0] < p[0] - 0.09 and bug[2] > p[2] + 0.038  # under-proposed token starved, over-proposed inflated


def test_the_roofline_numbers_are_the_docs():
    from spec.figures import roofline_numbers

    spark, h200 = roofline_numbers()
    # float64 formulas against the figures as quoted: +- half a unit in the last quoted place
    assert spark["step_ms"] == pytest.approx(58.8, abs=0.05) and spark["tok_s"] == pytest.approx(17.0, abs=0.05)
    assert h200["step_ms"] == pytest.approx(3.75, abs=0.005) and h200["tok_s"] == pytest.approx(266.5, abs=0.05)
    assert h200["ridge_flop_per_byte"] == pytest.approx(231, abs=0.5)


def test_the_speedup_figure_marks_the_calculators_best_k():
    from spec import calc
    from spec.figures import speedup_numbers

    for row in speedup_numbers():
        assert (row["best_k"], row["best_x"]) == calc.best_k(row["alpha"], row["c"], len(row["speedup"]) - 1)
        assert row["speedup"][row["best_k"]] == max(row["speedup"])
