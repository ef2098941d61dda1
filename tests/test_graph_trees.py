"""Token trees on the graph backend's static cache, on a CPU (graphs off: the layer stack and SDPA with the tree
mask; the fused kernels' tree mask is checked in Triton's interpreter in test_kernels.py and on a GPU there): a tree
forward scores each branch as a fresh forward of its path would, `keep` compacts the accepted path, a tree of up to
64 tokens is one forward and a longer one (64 nodes and their root) runs in chunks at the right slots and positions,
`prepare` captures tree forwards ahead, and whole greedy runs with trees write plain decoding's text."""

import pytest
import torch

from spec import tree
from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel, ModelError
from spec.models.graph import SPAN_STEP, GraphModel

# fp32 logits of the tiny models through differently shaped products: rounding only (6e-6 measured on trees in the
# eager backend); a wrong mask, position or slot moves them by more than 0.1.
FP32_SHAPES = 1e-4
TEXT = list(b"def add(a, b):")
# A tree of 6 nodes: two children of the root, each with children; breadth-first, parents before children.
NODES, PARENTS = [32, 114, 119, 10, 97, 115], (-1, -1, 0, 0, 1, 2)


@pytest.fixture(scope="module")
def graph_pair(tiny):
    def wrap(model):
        return GraphModel(model.model, model.vocab, max_length=2 * SPAN_STEP, graphs=False)
    return wrap(tiny.target), wrap(tiny.draft)


def fresh_rows(model, text, nodes, parents):
    """The logits a fresh forward of each node's whole path gives at that node."""
    rows = []
    for node in range(len(nodes)):
        model.reset()
        rows.append(model.forward(text + [nodes[a] for a in tree.ancestry(parents, node)])[-1])
    model.reset()
    return torch.stack(rows)


def test_a_tree_forward_scores_every_branch_as_a_fresh_forward_would(graph_pair):
    model = graph_pair[0]
    model.reset()
    model.forward(TEXT, keep=1)
    rows = model.forward(NODES, tree=tree.layout(PARENTS, 0, len(NODES), len(TEXT)))
    assert model.length == len(TEXT) + len(NODES)
    assert (rows - fresh_rows(model, TEXT, NODES, PARENTS)).abs().max() < FP32_SHAPES


def test_a_tree_grown_depth_by_depth_sees_only_its_ancestors_among_cached_nodes(graph_pair):
    """As a drafter grows a tree: the first depth, then the next over the cached first (`first` > 0), whose
    siblings' cache entries must stay invisible."""
    model = graph_pair[0]
    model.reset()
    model.forward(TEXT, keep=1)
    model.forward(NODES[:2], tree=tree.layout(PARENTS, 0, 2, len(TEXT)))
    rows = model.forward(NODES[2:], tree=tree.layout(PARENTS, 2, 4, len(TEXT)))
    assert (rows - fresh_rows(model, TEXT, NODES, PARENTS)[2:]).abs().max() < FP32_SHAPES


def test_keeping_the_accepted_path_compacts_its_cache_entries(graph_pair):
    model = graph_pair[0]
    model.reset()
    model.forward(TEXT, keep=1)
    model.forward(NODES, tree=tree.layout(PARENTS, 0, len(NODES), len(TEXT)))
    path = [1, 4]  # 114, then its child 97: slots len(TEXT) + 1 and + 4
    model.keep(len(TEXT), [len(TEXT) + i for i in path])
    assert model.length == len(TEXT) + 2
    after = model.forward([101, 114])
    model.reset()
    fresh = model.forward(TEXT + [114, 97, 101, 114])[-2:]
    assert (after - fresh).abs().max() < FP32_SHAPES
    with pytest.raises(ValueError, match="slots"):
        model.keep(2, [1])
    model.reset()


def test_a_layout_that_does_not_fit_the_cache_is_refused(graph_pair):
    model = graph_pair[0]
    model.reset()
    model.forward(TEXT)
    with pytest.raises(ModelError, match="does not fit"):
        model.forward(NODES, tree=tree.layout(PARENTS, 0, len(NODES), len(TEXT) - 1))
    model.reset()


def shape_parents(shape) -> tuple[int, ...]:
    """A static shape's parents, breadth-first."""
    parents, frontier = [], [-1]
    for branching in shape:
        frontier = [parents.append(p) or len(parents) - 1 for p in frontier for _ in range(branching)]
    return tuple(parents)


class _ReplayedTreeStep:
    """A stand-in for a captured CUDA graph of `GraphModel._step` on a CPU (the layer stack in its place)."""

    def __init__(self, model, n: int, span: torch.Tensor, tree_mode: bool):
        self.model, self.span, self.tree = model, span, tree_mode
        self.ids = torch.zeros(n, dtype=torch.long)
        self.logits = torch.empty(n, model.vocab)

    def replay(self):
        self.logits.copy_(self.model._head(self.model._run_body(self.ids, self.span, self.tree)))


def as_fused(tiny) -> tuple[GraphModel, list]:
    """The tiny target on a CPU laid out as a fused model on a GPU (16-token chunks, graphs), each graph replay
    standing in as the layer stack and recorded as (tokens, tree)."""
    model = GraphModel(tiny.target.model, tiny.target.vocab, max_length=2 * SPAN_STEP, graphs=False)
    model.graphs, replays = True, []
    model.fused_tokens = model.prefill_chunk = model.graph_tokens = 16  # as a fused model's

    def graph(n, span, tree=False):
        if torch.is_grad_enabled():  # a capture writes the caches; with grad on, torch refuses (fp32 on a GPU)
            raise RuntimeError("graph captured with grad enabled")
        replays.append((n, tree))
        step = _ReplayedTreeStep(model, n, span, tree)
        return step, step.ids, step.logits

    model._graph = graph
    return model, replays


def test_a_tree_of_up_to_64_tokens_is_one_graphed_forward(graph_pair, tiny):
    """40 nodes (a 4-wide tree) in one forward, not in chunks of 16: the fused kernels take a tree's 64 tokens at
    once, reading the weights once for all of them."""
    model, replays = as_fused(tiny)
    parents = shape_parents((4, 3, 2))  # 4 + 12 + 24 nodes
    nodes = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    model.forward(TEXT, keep=1)
    rows = model.forward(nodes, tree=tree.layout(parents, 0, 40, len(TEXT)), keep=30)
    assert replays[-1:] == [(40, True)] and model.length == len(TEXT) + 40
    expected = fresh_rows(graph_pair[0], TEXT, nodes, parents)[10:]
    assert (rows - expected).abs().max() < FP32_SHAPES


def test_a_64_node_tree_with_its_root_runs_in_chunks_at_the_right_slots(graph_pair, tiny):
    """The largest verify: 64 nodes and the uncached token they grow from, 65 tokens, past one fused forward: in
    chunks of 16 as on a GPU, the last one padded as a prompt's; each chunk's graph reads its tokens' masks and
    positions, later chunks see the earlier chunks' ancestors through the cache, and the root, outside the mask's
    64-slot window, is seen by every node."""
    model, replays = as_fused(tiny)
    parents = shape_parents((8, 7))  # 8 + 56 nodes
    nodes = torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    model.forward(TEXT[:-1], keep=1)
    fed = TEXT[-1:] + nodes
    rows = model.forward(fed, tree=tree.layout(tree.with_prefix(parents, 1), 0, 65, len(TEXT) - 1))
    assert replays[-5:] == [(16, True)] * 5 and model.length == len(TEXT) + 64
    expected = fresh_rows(graph_pair[0], TEXT, nodes, parents)
    assert (rows[1:] - expected).abs().max() < FP32_SHAPES
    graph_pair[0].reset()
    assert (rows[0] - graph_pair[0].forward(TEXT)[-1]).abs().max() < FP32_SHAPES
    graph_pair[0].reset()


def test_a_mask_the_kernels_cannot_express_is_refused_before_anything_runs(tiny):
    """65 tokens whose first two are both roots: the second hides the first, which lies before the mask's 64-slot
    window. The kernels cannot express that; the forward says so and leaves the cache as it was."""
    model, replays = as_fused(tiny)
    model.forward(TEXT, keep=1)
    parents = (-1, -1, *range(1, 64))  # node 1 is a second root, the rest a chain under it
    layout = tree.layout(parents, 0, 65, len(TEXT))
    assert layout.window is None
    with pytest.raises(ModelError, match="hidden slots"):
        model.forward(list(range(3, 68)), tree=layout)
    assert model.length == len(TEXT) and not any(t for _, t in replays)


def test_prepare_captures_tree_forwards_ahead(tiny, monkeypatch):
    """With tree_tokens, `prepare` captures a tree forward's graph for each node count, so none is captured
    mid-generation; without, none; all with grad off, as `forward`. (Compiling the kernels ahead is left out: the
    stand-in runs no kernels, and where Triton is installed it would try to.)"""
    import contextlib

    from spec.models import kernels

    monkeypatch.setattr(kernels, "compiling_ahead", lambda: contextlib.nullcontext(False))
    model, replays = as_fused(tiny)
    model.prepare(5, 100)
    assert not any(t for _, t in replays)
    model.prepare(5, 100, tree_tokens=17)
    assert sorted(n for n, t in replays if t) == list(range(1, 18)) and model.length == 0


@pytest.mark.parametrize("shape", [(2, 2, 1), (3, 1, 1, 1), (4,)])
def test_greedy_trees_on_the_static_cache_write_plain_decodings_text(graph_pair, shape):
    target, draft = graph_pair
    prompt = list(b"def fibonacci(n):\n    ")
    plain = generate(EagerModel(target.model, target.vocab), NoDrafter(), prompt, 40, k=0).tokens
    result = generate(target, ModelDrafter(draft, shape), prompt, 40, k=len(shape))
    assert result.tokens == plain and result.accepted > 0
    assert max(r.drafted for r in result.rounds) == tree.nodes_of(shape)


def test_greedy_dynamic_trees_on_the_static_cache_write_plain_decodings_text(graph_pair):
    target, draft = graph_pair
    prompt = list(b"class Stack:\n    def ")
    plain = generate(target, NoDrafter(), prompt, 40, k=0).tokens
    result = generate(target, ModelDrafter(draft, tree.Dynamic(8, 2)), prompt, 40, k=4)
    assert result.tokens == plain and result.accepted > 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tree_forwards_match_the_layer_stack(dtype):
    """Graphed, on the GPU: the fused kernels' tree path (a graph per node count; 40 and 64 nodes in one pass) against
    the layer stack with the same trees, whole and grown node by node, and after `keep`: within fp32 rounding in
    fp32; in bf16 within the fused step's own error against that stack on chains, plus one ulp of a logit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_kernels import small_model

    model = small_model("qwen2", dtype)
    fused = GraphModel(model, max_length=2 * SPAN_STEP, split_attention=True, fused_step=True)  # fp32 too
    stack = GraphModel(model, max_length=2 * SPAN_STEP, split_attention=False, fused_step=False, compile=False)
    assert fused.fused_step
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(0, 300, (37,), generator=gen).tolist()
    chain = torch.randint(0, 300, (9,), generator=gen).tolist()
    errors = {}
    for name, shape in (("chain", None), ("trees", (2, 2, 1)), ("trees", (4, 3, 2)), ("trees", (8, 7))):
        parents = shape_parents(shape) if shape else ()
        nodes = torch.randint(0, 300, (len(parents),), generator=gen).tolist() if shape else chain
        outs = []
        for m in (stack, fused):
            m.reset()
            m.forward(text, keep=1)
            # the chain through the causal path: the fused step's own error, which the trees' is held to
            rows = [m.forward(nodes, tree=tree.layout(parents, 0, len(nodes), len(text)) if shape else None)]
            if shape:
                m.rollback(len(text))
                rows += [m.forward(nodes[i : i + 1], tree=tree.layout(parents, i, 1, len(text)))
                         for i in range(len(nodes))]
                m.keep(len(text), [len(text) + 1, len(text) + shape[0] + shape[1]])
                rows.append(m.forward([7, 8, 9]))
            outs.append(torch.cat(rows))
        errors[name] = max(errors.get(name, 0.0), (outs[0] - outs[1]).abs().max().item())
    if dtype == torch.float32:
        assert errors["trees"] < 1e-3, errors
    else:
        assert errors["trees"] <= 2 * errors["chain"] + 0.0625, errors


@cuda
@pytest.mark.parametrize("spec", [(2, 2, 1), (4, 2, 2, 1), tree.Dynamic(16, 4)])
def test_cuda_graph_trees_write_plain_decodings_text(spec):
    """The whole loop with trees on the graph backend (fp32, the tiny pair on the GPU): plain greedy's text."""
    from spec.models import load_pair

    pair = load_pair("tiny", device="cuda", backend="graph")
    prompt = list(b"def fibonacci(n):\n    ")
    plain = generate(pair.target, NoDrafter("cuda"), prompt, 48, k=0).tokens
    depth = len(spec) if isinstance(spec, tuple) else 4
    result = generate(pair.target, ModelDrafter(pair.draft, spec), prompt, 48, k=depth)
    assert result.tokens == plain and result.accepted > 0


def test_bench_engines_tree_timing_leaves_the_cache_at_its_context(tiny):
    """`bench_engine.tree_ms` (issue 19's bars) on the static cache, with and without cached nodes: it runs the
    tree forwards it times and rolls each repetition back to the context."""
    import math

    from spec.bench_engine import tree_ms

    model = GraphModel(tiny.target.model, tiny.target.vocab, max_length=2 * SPAN_STEP, graphs=False)
    for cached in (0, 4):
        ms = tree_ms(model, torch.tensor(TEXT), 8, reps=2, vocab=model.vocab, cached=cached)
        assert math.isfinite(ms) and model.length == len(TEXT)


def test_bench_engine_judges_issue_19s_bars_on_the_headline_backend(tiny, tmp_path, monkeypatch):
    """A CPU run of `spec.bench_engine` with --tree-nodes: the headline backend's tree ratios get their own keys,
    judged against issue 19's bars, and the judge misses a NaN, passes a value at its bar and skips what was not
    measured."""
    import json

    from spec import bench_engine

    monkeypatch.chdir(tmp_path)
    bench_engine.main(["--pair", "tiny", "--device", "cpu", "--backends", "eager,static", "--ns", "1",
                       "--tree-nodes", "16", "--parts", "speed", "--no-hf", "--reps", "2", "--tokens", "8",
                       "--context", "32"])
    data = json.loads(next((tmp_path / "results").glob("bench_engine-*.json")).read_text())
    assert data["graph_backend"] == "static"
    assert data["tree_verify_ratio_16_over_1"] == data["tree_verify_ratio_16_over_1_static"]
    assert data["tree_draft_frontier_8_over_step"] == data["tree_draft_frontier_8_over_step_static"]
    bars = data["bars"]
    assert bars["tree_verify_ratio_16_over_1"]["bar"] == "<= 1.12"
    assert bars["tree_draft_frontier_8_over_step"]["bar"] == "<= 1.4"
    assert "tree_verify_ratio_32_over_1" not in bars  # not measured: not judged
    judged = bench_engine.judge_bars({"tree_verify_ratio_16_over_1": 1.12, "tree_verify_ratio_64_over_1": 1.5001,
                                      "graph_plain_tok_s": float("nan"), "c_graph": 0.2})
    assert {key: bar["pass"] for key, bar in judged.items()} == {
        "tree_verify_ratio_16_over_1": True, "tree_verify_ratio_64_over_1": False, "graph_plain_tok_s": False,
        "c_graph": True}
