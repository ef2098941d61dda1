"""The house's shape: no import cycles, a declared model interface both backends implement, a torch-free
benchmark client, and the deliberately wrong code kept off the product path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from spec.models import EagerModel, GraphModel, Model

ROOT = Path(__file__).resolve().parent.parent
# Function-level imports of our own modules are allowed only where the module needs an optional library.
LAZY_OK = {"spec.models.triton_kernels"}  # imports Triton, which CPU-only machines lack


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in (ROOT / "spec").rglob("*.py")}
    found.update({name: ROOT / f"{name}.py" for name in ("bench", "server_spec")})
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """Our modules that `path` imports, anywhere in it (module level or inside functions): (name, inside a
    function). `from spec.models import kernels` names the submodule when there is one."""
    tree = ast.parse(path.read_text())
    nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        out += [(name, id(node) in nested) for name in names if name in known]
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {target for target, _ in imports(path, known)} - {name} for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `edges` as a list of nodes, or None. Depth-first, colouring nodes grey while on the stack."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_function_level_import_of_our_own_modules():
    known = modules()
    lazy = {(name, target) for name, path in known.items() for target, inside in imports(path, known)
            if inside and target not in LAZY_OK}
    assert not lazy


def reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += edges.get(node, ())
    return seen


PRODUCT = ["spec.loop", "spec.rules", "spec.drafters", "spec.policy", "spec.models", "spec.serving.app",
           "spec.serving.cli", "server_spec", "bench", "spec.harness"]


@pytest.mark.parametrize("module", PRODUCT)
def test_the_deliberately_wrong_code_is_off_the_product_path(module):
    assert "spec.deliberately_wrong" not in reachable(module, graph())


def test_bench_is_a_pure_client():
    code = "import bench, sys; assert 'torch' not in sys.modules, 'bench.py imported torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_both_backends_implement_the_model_interface(tiny):
    assert isinstance(tiny.target, EagerModel) and isinstance(tiny.target, Model)
    static = GraphModel(tiny.target.model, tiny.target.vocab, "static", max_length=64, graphs=False)
    assert isinstance(static, Model)
    assert not isinstance(object(), Model)


# calc is the speedup formula, which the policy uses, with a command line of its own: library, not a task.
TASKS = {"spec.check_pair", "spec.verify_cost", "spec.spec_greedy", "spec.spec_sample", "spec.dist_test",
         "spec.sweep", "spec.lookup", "spec.bench_engine", "spec.tune_kernels", "spec.figures"}


def test_the_library_never_imports_a_task_and_models_stand_alone():
    edges = graph()
    library = {name for name in edges if name.startswith("spec") and name not in TASKS}
    assert not {(name, target) for name in library for target in edges[name] if target in TASKS}
    models = {name for name in edges if name.startswith("spec.models")}
    outside = {target for name in models for target in edges[name] if not target.startswith("spec.models")}
    assert outside <= {"spec.log"}
