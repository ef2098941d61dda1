"""Token trees: bookkeeping, the tree forward and cache compaction against fresh forwards, the tree rules (on chains
they are the chain rules; on toy trees a chi-square with stated power, and a naive rule that fails), and the whole
loop with trees on the tiny pair (greedy identity, coupled identity, the joint law of the first tokens)."""

import random

import numpy as np
import pytest
import torch

from spec import tree
from spec.chisquare import LEVEL, POWER_GOAL, categorize, chi_square, merge_bins, pilot_power, sequence_law
from spec.deliberately_wrong import DrawScoredDrafter, naive_tree_accept
from spec.dist_test import LOOP_PROMPT, loop_outputs, one_thread
from spec.drafters import LookupDrafter, ModelDrafter, NoDrafter, lookup_continuations, make_drafter
from spec.loop import generate
from spec.rules import accept_or_fix, greedy_rule, tree_accept, tree_greedy
from spec.warps import Decoding, Sampling

# fp32 logits of the tiny models through differently shaped products (a tree forward against one-token steps)
# differ by rounding only: 6e-6 measured; a wrong mask or position moves them by more than 0.1.
FP32_SHAPES = 1e-4


# ---- bookkeeping -----------------------------------------------------------------------------------------------


def test_shapes_parse_and_count():
    assert tree.parse_shape("3,2,1") == (3, 2, 1) and tree.nodes_of((3, 2, 1)) == 15
    assert tree.widths((3, 2, 1)) == [3, 6, 6] and tree.parse_shape("chain") == (1,)
    for bad in ["", "3,,1", "0,2", "a", "2.5", "4,4,4"]:  # 4,4,4 has 84 nodes, more than a verify holds
        with pytest.raises(ValueError, match="shape"):
            tree.parse_shape(bad)


def test_tree_settings_parse():
    assert tree.parse_tree("2,2,1") == (2, 2, 1) and tree.parse_tree("auto") == tree.Auto(16)
    assert tree.parse_tree("dynamic:16") == tree.Dynamic(16, 4) and tree.parse_tree("dynamic:3") == tree.Dynamic(3, 3)
    assert tree.parse_tree("dynamic:16:2") == tree.Dynamic(16, 2) and tree.parse_tree("auto:32") == tree.Auto(32)
    assert tree.describe(tree.Dynamic(16, 2)) == "dynamic:16:2" and tree.describe((3, 1)) == "3,1"
    for bad in ["dynamic", "dynamic:0", "dynamic:65", "dynamic:8:0", "dynamic:8:2:1", "auto:0", "auto:x", "dyn:4"]:
        with pytest.raises(ValueError):
            tree.parse_tree(bad)


def test_visits_report_the_slot_taken_at_each_node():
    parents = (-1, -1, 0, 0)
    assert tree.visits(parents, [1]) == [(1, 2)]  # the root's second child, a leaf: nothing offered there
    assert tree.visits(parents, [0]) == [(0, 2), (2, 2)]  # then neither of node 0's two children
    assert tree.visits(parents, [0, 3]) == [(0, 2), (1, 2)]
    assert tree.visits(tree.chain(4), [0, 1]) == [(0, 1), (0, 1), (1, 1)]
    assert tree.visits((), []) == []  # nothing drafted: nothing seen


def test_a_trie_is_numbered_breadth_first_with_distinct_siblings():
    tokens, parents = tree.from_paths([[5, 6, 9], [5, 7], [8], [5, 6]])
    assert tokens == [5, 8, 6, 7, 9] and parents == (-1, -1, 0, 0, 2)
    assert tree.depths(parents) == [1, 1, 2, 2, 3] and tree.ancestry(parents, 4) == [0, 2, 4]
    assert tree.children(parents) == {-1: [0, 1], 0: [2, 3], 1: [], 2: [4], 3: [], 4: []}


def test_layout_sees_the_text_and_the_ancestors_only():
    parents = (-1, -1, 0)
    laid = tree.layout(parents, 1, 2, start=4)  # nodes 1 and 2; node 0 is cached at slot 4
    positions, visible = laid.positions, laid.visible
    assert positions.tolist() == [4, 5]  # depth 1 and depth 2 after a text of 4
    assert visible.tolist() == [[True] * 4 + [False, True, False], [True] * 4 + [True, False, True]]
    prefixed = tree.with_prefix(parents, 2)  # two uncached true tokens before the tree
    assert prefixed == (-1, 0, 1, 1, 2) and tree.is_chain(tree.chain(4)) and not tree.is_chain(parents)


def test_layouts_reach_the_device_without_waiting_for_it(monkeypatch):
    """A tree round builds a layout for each draft depth and for the verify; a blocking copy to a GPU waits for all
    the work queued there, so each would stop the CPU from running ahead (about 1 ms a round on an H200). A device
    that computes nothing (meta) stands in for the GPU: every copy to it must be non-blocking."""
    copies = []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out.device.type == "meta" and self.device.type == "cpu":
            copies.append(kwargs.get("non_blocking", False))
        return out

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    layout = tree.layout((-1, -1, 0, 1), 0, 4, start=9, device="meta")
    assert layout.visible.device.type == "meta" and copies == [True, True, True]  # window, positions, visible


def test_a_layouts_window_is_its_mask_as_the_graph_kernels_read_it():
    """`window` (made on the host) against the bits computed from `visible` on the device as the graph backend did
    before, on random trees and texts, 64 slots and more: equal, and None exactly where a token hides a slot that
    lies before the last 64."""
    rng = random.Random(0)
    checked = refused = 0
    for _ in range(600):
        n = rng.randint(1, 70)
        parents = tuple(rng.randint(-1, i - 1) if rng.random() < 0.7 else i - 1 for i in range(n))
        first = rng.randint(0, n - 1)
        count = rng.randint(1, n - first)
        layout = tree.layout(parents, first, count, start=rng.randint(0, 200))
        end = layout.visible.shape[1]
        base = max(0, end - 64)
        bits = (layout.visible[:, base:].long() << torch.arange(end - base)).sum(1)
        expressible = bool(layout.visible[:, :base].all())
        assert (layout.window is not None) == expressible
        if expressible:
            assert layout.window.tolist() == [base, *bits.tolist()]
        checked, refused = checked + expressible, refused + (not expressible)
    assert checked > 500 and refused > 0  # both cases met


def test_lookup_offers_several_continuations():
    seq = [5, 6, 7, 5, 6, 8, 5, 6]
    assert lookup_continuations(seq, 1, branches=2) == [[8], [7]]
    assert lookup_continuations(seq, 2, branches=3) == [[8, 5], [7, 5]]  # only two earlier matches of (5, 6)
    draft = LookupDrafter(branches=2).propose(seq, 2, Decoding(Sampling()), None)
    assert draft.tokens.tolist() == [8, 7, 5, 5] and draft.parents == (-1, -1, 0, 1) and draft.q is None


# ---- the tree forward and the caches -----------------------------------------------------------------------------


TEXT = [72, 101, 108, 108, 111]
NODES, PARENTS = [32, 44, 119, 33, 119, 10], (-1, -1, 0, 0, 1, 2)


def tree_forward(model):
    """A cached TEXT, then the 6-node tree NODES in one forward: its rows."""
    model.reset()
    model.forward(TEXT, keep=1)
    return model.forward(NODES, tree=tree.layout(PARENTS, 0, len(NODES), len(TEXT)))


def test_a_tree_forward_scores_every_branch_as_a_fresh_forward_would(tiny):
    model, text, tokens, parents = tiny.target, TEXT, NODES, PARENTS
    rows = tree_forward(model)
    for node in range(6):
        path = [tokens[a] for a in tree.ancestry(parents, node)]
        model.reset()
        fresh = model.forward(text + path)[-1]
        assert (rows[node] - fresh).abs().max() < FP32_SHAPES
    model.reset()


def test_keeping_the_accepted_path_leaves_the_cache_of_the_accepted_text(tiny):
    model, text = tiny.target, TEXT
    tree_forward(model)
    path = [0, 2, 5]  # 32, 119, 10: slots 5, 7, 10
    model.keep(len(text), [len(text) + i for i in path])
    assert model.length == len(text) + 3
    after = model.forward([101, 114])
    model.reset()
    fresh = model.forward(text + [32, 119, 10, 101, 114])[-2:]
    assert (after - fresh).abs().max() < FP32_SHAPES
    model.reset()
    with pytest.raises(ValueError, match="slots"):
        model.forward(text)
        model.keep(2, [1])


def test_a_tree_drafter_keeps_its_accepted_path_like_a_fresh_drafter(tiny):
    """After a tree round the draft cache holds the accepted nodes only: the next proposal is the one a fresh
    drafter makes from the true text."""
    decoding = Decoding(Sampling())
    prompt = list(b"def add(a, b):")
    drafter = ModelDrafter(tiny.draft, (2, 2, 1))
    drafter.rollback(0)
    drafter.prefill(prompt[:-1])
    first = drafter.propose(prompt, 3, decoding, None)
    assert len(first.tokens) == 2 + 4 + 4 and first.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    path = [1, 4]  # the second child of the root, then its first child: both fed to the draft
    seq = prompt + [int(first.tokens[1]), int(first.tokens[4]), 65]
    drafter.rollback(len(seq) - 1, path)
    again = drafter.propose(seq, 3, decoding, None)
    fresh = ModelDrafter(tiny.draft, (2, 2, 1))
    fresh.rollback(0)
    fresh.prefill(seq[:-1])
    assert again.tokens.tolist() == fresh.propose(seq, 3, decoding, None).tokens.tolist()
    tiny.draft.reset()


# ---- the rules on hand-built rows --------------------------------------------------------------------------------


def test_tree_greedy_descends_while_the_argmax_is_a_child():
    tokens, parents = torch.tensor([7, 4, 3, 9]), (-1, -1, 1, 1)  # root: 7, 4; node 1 (4): 3, 9
    scores = torch.zeros(5, 10)
    scores[0, 4] = scores[2, 9] = scores[4, 1] = 1.0  # root -> 4 (node 1) -> 9 (node 3) -> bonus 1
    assert tree_greedy(scores, tokens, parents) == ([1, 3], 1)
    scores[2, 9], scores[2, 5] = 0.0, 1.0  # at node 1 the target wants 5: not a child
    assert tree_greedy(scores, tokens, parents) == ([1], 5)


def test_on_chains_the_tree_rules_are_the_chain_rules_draw_for_draw():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        k, vocab = int(torch.randint(1, 6, (), generator=gen)), 8
        p = torch.rand(k + 1, vocab, generator=gen).pow(3).softmax(-1)
        q = torch.rand(k, vocab, generator=gen).pow(3).softmax(-1)
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1)
        if trial % 3 == 0:
            drafts[: k // 2] = p[: k // 2].argmax(-1)  # long accepted runs too
        n, nxt = greedy_rule(p[None], drafts[None])
        assert tree_greedy(p, drafts, tree.chain(k)) == (list(range(int(n))), int(nxt))
        for one_hot in (False, True):
            q_rows = None if one_hot else q
            n, nxt = accept_or_fix(p[None], None if one_hot else q[None], drafts[None],
                                   torch.Generator().manual_seed(trial))
            got = tree_accept(p, q_rows, drafts, tree.chain(k), torch.Generator().manual_seed(trial))
            assert got == (list(range(int(n))), int(nxt))


# A toy world of 6 tokens, two positions deep: the target's p0 at the root and p1[a] after token a; the draft's q0
# and q1[a]. Trees of shape (3, 2) are drawn as the draft model draws them (top-b, or b draws without replacement).
V = 6
P0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05], dtype=torch.float64)
Q0 = torch.tensor([0.10, 0.35, 0.05, 0.30, 0.15, 0.05], dtype=torch.float64)
P1 = torch.stack([P0.roll(a) for a in range(V)])
Q1 = torch.stack([Q0.roll(2 * a) for a in range(V)])
LEAF = torch.full((V,), 1.0 / V, dtype=torch.float64)  # the target after two tokens (only the bonus uses it)
TOY_N = 20_000


def toy_tree(sampled: bool, gen: torch.Generator, shape=(3, 2)):
    """(tokens, parents, q, p) of one tree drawn by the drafter's own child rule in the toy world."""
    decoding = Decoding(Sampling(1.0) if sampled else Sampling())
    tokens, parents, qs, ps = [], [], [], [P0]
    frontier = [(-1, Q0, P1)]
    for depth, branching in enumerate(shape):
        grown = []
        for node, q_row, p_next in frontier:
            picked, q, _ = ModelDrafter._children(q_row.log().float(), [], depth, branching, decoding, gen)
            for token in picked.tolist():
                tokens.append(token)
                parents.append(node)
                qs.append(q)
                ps.append(p_next[token] if depth == 0 else LEAF)
                grown.append((len(tokens) - 1, Q1[token], None))
        frontier = grown
    return torch.tensor(tokens), tuple(parents), (torch.stack(qs) if sampled else None), torch.stack(ps)


def first_two(rule, sampled: bool, n: int, seed: int) -> np.ndarray:
    """Categories a * V + b of the first two tokens of n rounds (a second token drawn from p1 when a round emits
    one), and the rounds that left the root by a child."""
    gen = torch.Generator().manual_seed(seed)
    cats, left = [], 0
    for _ in range(n):
        tokens, parents, q, p = toy_tree(sampled, gen)
        path, nxt = rule(p, q, tokens, parents, gen)
        out = [int(tokens[i]) for i in path] + [nxt]
        if len(out) == 1:
            out.append(int(torch.multinomial(P1[out[0]][None], 1, generator=gen)))
        cats.append(out[0] * V + out[1])
        left += bool(path)
    return np.array(cats), left / n


JOINT = (P0[:, None] * P1).flatten().numpy()


@pytest.mark.parametrize("sampled", [False, True], ids=["top-b children", "sampled children"])
def test_the_tree_rule_gives_the_targets_joint_law_and_a_naive_rule_does_not(sampled):
    """Chi-square of the first two tokens (36 cells) over 20000 toy rounds: the rule passes; the naive rule (keep
    the first child with min(1, p/q), else draw from p) fails, with its power from an independent pilot."""
    bins = merge_bins(JOINT, TOY_N)
    cats, _ = first_two(tree_accept, sampled, TOY_N, 0)
    assert chi_square(cats, JOINT, bins)[2] >= LEVEL
    naive, _ = first_two(naive_tree_accept, sampled, TOY_N, 1)
    pilot, _ = first_two(naive_tree_accept, sampled, TOY_N, 2)
    assert pilot_power(pilot, JOINT, bins, TOY_N) >= POWER_GOAL
    assert chi_square(naive, JOINT, bins)[2] < LEVEL


@pytest.mark.parametrize("sampled", [False, True], ids=["top-b children", "sampled children"])
def test_the_tree_rule_leaves_the_root_at_least_as_often_as_the_simple_rule(sampled):
    """The simple exact rule draws y from p0 and descends if y is a child: it leaves the root with probability
    E[p0(children)], computed here over the same kind of trees. With top-b children the two are equal (both sum p0
    over q0's top 3 tokens: 0.25 + 0.12 + 0.08); with sampled children the rule does better. Bounds: 4 standard
    errors of the two estimates (a false failure under 1e-4)."""
    gen = torch.Generator().manual_seed(3)
    simple = np.array([float(P0[toy_tree(sampled, gen)[0][:3]].sum()) for _ in range(4000)])
    _, left = first_two(tree_accept, sampled, TOY_N, 4)
    se = (left * (1 - left) / TOY_N + simple.var() / len(simple)) ** 0.5
    if sampled:
        assert left >= simple.mean() - 4 * se
        assert left > 0.65 + 4 * se  # one sampled child leaves with sum min(p0, q0) = 0.65; three do better
    else:
        assert simple.mean() == pytest.approx(0.45)  # float64 sums of literals
        assert abs(left - 0.45) <= 4 * se


# ---- the whole loop with trees on the tiny pair ------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 2, 1), (3, 1, 1, 1), (4,), (2, 2, 2, 2)])
def test_greedy_trees_write_plain_decodings_text(tiny, shape):
    prompt = list(b"def fibonacci(n):\n    ")
    plain = generate(tiny.target, NoDrafter(), prompt, 40, k=0).tokens
    result = generate(tiny.target, ModelDrafter(tiny.draft, shape), prompt, 40, k=len(shape))
    assert result.tokens == plain and result.accepted > 0
    assert max(r.drafted for r in result.rounds) == tree.nodes_of(shape)  # whole trees were verified


def test_lookup_trees_write_plain_decodings_text(tiny):
    prompt = list(b"x = [1, 2, 3]\ny = [1, 2, 4]\nz = [1, 2, 5]\nw = [1, 2")
    plain = generate(tiny.target, NoDrafter(), prompt, 30, k=0).tokens
    result = generate(tiny.target, LookupDrafter(branches=3), prompt, 30, k=4)
    assert result.tokens == plain and any(r.drafted > 4 for r in result.rounds)  # some rounds were real trees


def test_coupled_sampling_with_trees_is_the_text_of_coupled_plain_decoding(tiny):
    sampling = Sampling(1.0, top_p=0.9, presence_penalty=0.5, coupled=True)
    prompt = list(b"The quick brown fox")
    for seed in (0, 1):
        plain = generate(tiny.target, NoDrafter(), prompt, 24, k=0, sampling=sampling, seed=seed).tokens
        tree_run = generate(tiny.target, ModelDrafter(tiny.draft, (3, 2, 1)), prompt, 24, k=3, sampling=sampling,
                            seed=seed).tokens
        assert tree_run == plain


def test_greedy_trees_with_penalties_warp_each_node_along_its_own_path(tiny):
    sampling = Sampling(presence_penalty=1.5, repetition_penalty=1.3)
    prompt = list(b"aaaa bbbb aaaa bbbb")
    plain = generate(tiny.target, NoDrafter(), prompt, 30, k=0, sampling=sampling).tokens
    assert generate(tiny.target, ModelDrafter(tiny.draft, (2, 2, 2)), prompt, 30, k=3, sampling=sampling).tokens \
        == plain


LOOP_N = 400  # generations, as tests/test_dist.py's loop test


@one_thread()
def test_sampled_trees_in_the_whole_loop_follow_the_targets_law_of_the_first_tokens(tiny):
    """The first 3 tokens of 400 sampled generations (temperature 1.5, tree (3, 2)) against the target's exact law
    of its first 3 tokens, as tests/test_dist.py checks the chain."""
    sampling = Sampling(1.5)
    prompt = tiny.tokenizer(LOOP_PROMPT).input_ids
    nodes, probs = sequence_law(tiny.target, prompt, 3, sampling, LOOP_N)
    bins = merge_bins(probs, LOOP_N)
    outputs = loop_outputs(tiny.target, ModelDrafter(tiny.draft, (3, 2)), prompt, 3, 2, sampling, LOOP_N, 0,
                           "tree loop")
    assert chi_square(categorize(outputs, nodes, 3), probs, bins)[2] >= LEVEL


def test_trees_need_a_draft_of_the_targets_tokenizer(tiny):
    pair = type("Remapped", (), {"draft": tiny.draft, "draft_tokenizer": object(), "tokenizer": None,
                                 "target": tiny.target})()
    with pytest.raises(ValueError, match="tokenizer"):
        make_drafter("draft", pair, shape=(2, 1))


# ---- dynamic trees (EAGLE-2's node budget by path score) -----------------------------------------------------------


@pytest.mark.parametrize("spec", [tree.Dynamic(1, 4), tree.Dynamic(4, 2), tree.Dynamic(16, 4), tree.Dynamic(32, 4),
                                  tree.Dynamic(12, 3)], ids=str)
def test_greedy_dynamic_trees_write_plain_decodings_text(tiny, spec):
    prompt = list(b"def fibonacci(n):\n    ")
    plain = generate(tiny.target, NoDrafter(), prompt, 40, k=0).tokens
    result = generate(tiny.target, ModelDrafter(tiny.draft, spec), prompt, 40, k=4)
    assert result.tokens == plain and result.accepted > 0
    # whole budgets were used: K = 4 depths offer at most width + 3 width^2 candidates
    assert max(r.drafted for r in result.rounds) == min(spec.budget, spec.width + 3 * spec.width ** 2)


def test_a_dynamic_tree_of_one_node_is_the_chain_of_one(tiny):
    prompt = list(b"def fibonacci(n):\n    ")
    chain = generate(tiny.target, ModelDrafter(tiny.draft), prompt, 40, k=1).rounds
    single = generate(tiny.target, ModelDrafter(tiny.draft, tree.Dynamic(1, 4)), prompt, 40, k=4).rounds
    assert [(r.tokens, r.drafted, r.forwards) for r in single] == [(r.tokens, r.drafted, r.forwards) for r in chain]


def dynamic_proposals(drafter, model, texts, k, decoding=None):
    """Each text's proposal (tokens, parents, forwards) from a drafter that reads the text fresh."""
    out = []
    for text in texts:
        drafter.rollback(0)
        drafter.prefill(text[:-1])
        draft = drafter.propose(text, k, decoding or Decoding(Sampling()), None)
        out.append((draft.tokens.tolist(), draft.parents, draft.forwards))
    model.reset()
    return out


TEXTS = [list(b"def add(a, b):"), list(b"The quick brown fox"), list(b"for i in range(10):\n    print(")]


def test_a_dynamic_tree_reads_its_scores_back_once_a_depth(tiny, monkeypatch):
    """A dynamic tree chooses each depth's frontier on the host, from its candidates' scores: one device -> host
    copy a depth, not one a node (on a GPU each waits for the device; 13 here before, greedy). Sampled, a depth also
    reads how many tokens each node can draw without replacement, once (13 more before)."""
    reads = []
    tolist, as_int = torch.Tensor.tolist, torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: reads.append("int") or as_int(self))
    k = 4
    for sampling, per_depth in ((Sampling(), 1), (Sampling(1.0), 2)):
        tiny.draft.reset()
        reads.clear()
        drafter = ModelDrafter(tiny.draft, tree.Dynamic(16, 4))
        draft = drafter.propose(TEXTS[0], k, Decoding(sampling), torch.Generator().manual_seed(0))
        assert len(draft.forwards) == k and len(reads) == per_depth * k, reads
    tiny.draft.reset()


def test_dynamic_trees_keep_the_budget_and_the_depth_and_reduce_to_static_shapes(tiny):
    """`budget` nodes (or all the candidates, if fewer), at most K deep, a tree (parents before children), at most
    `width` nodes a forward; with width = budget and K = 1
    it is the static shape (budget,), with width 1 the chain of min(budget, K); and dropping the frontier's pruning
    (expanding a node even when no child of it can make the budget) changes no tree, it only costs forwards."""
    for budget, width, k in [(16, 4, 4), (7, 3, 5), (30, 4, 3), (5, 2, 8)]:
        for tokens, parents, forwards in dynamic_proposals(ModelDrafter(tiny.draft, tree.Dynamic(budget, width)),
                                                          tiny.draft, TEXTS, k):
            parents = parents or tree.chain(len(tokens))
            assert len(tokens) == min(budget, width + (k - 1) * width ** 2)  # all the candidates K depths offer
            assert all(p < i for i, p in enumerate(parents)) and max(tree.depths(parents)) <= k
            assert len(forwards) <= k and max(forwards[1:], default=0) <= width
    for budget in (2, 3, 5):
        static = dynamic_proposals(ModelDrafter(tiny.draft, (budget,)), tiny.draft, TEXTS, 1)
        assert dynamic_proposals(ModelDrafter(tiny.draft, tree.Dynamic(budget, budget)), tiny.draft, TEXTS, 1) == static
        chain = dynamic_proposals(ModelDrafter(tiny.draft), tiny.draft, TEXTS, min(budget, 4))
        assert dynamic_proposals(ModelDrafter(tiny.draft, tree.Dynamic(budget, 1)), tiny.draft, TEXTS, 4) == chain

    class Unpruned(ModelDrafter):
        @staticmethod
        def _expand(made, parents, scores, plan):
            rank = {c: r for r, c in enumerate(sorted(range(len(scores)), key=lambda c: (-scores[c], c)))}
            return sorted(sorted(made, key=rank.__getitem__)[: plan.width])

    spec = tree.Dynamic(6, 3)
    pruned = dynamic_proposals(ModelDrafter(tiny.draft, spec), tiny.draft, TEXTS, 5)
    unpruned = dynamic_proposals(Unpruned(tiny.draft, spec), tiny.draft, TEXTS, 5)
    assert [p[:2] for p in pruned] == [p[:2] for p in unpruned]
    assert sum(map(sum, (p[2] for p in pruned))) < sum(map(sum, (p[2] for p in unpruned)))


def test_a_dynamic_tree_drafter_keeps_its_accepted_path_like_a_fresh_drafter(tiny):
    """The accepted path's nodes sit in the draft cache in feeding order, not in the tree's numbering, and some fed
    nodes are not in the tree at all: after keep, the next proposal is still a fresh drafter's."""
    decoding = Decoding(Sampling())
    spec = tree.Dynamic(10, 3)
    prompt = list(b"def add(a, b):")
    drafter = ModelDrafter(tiny.draft, spec)
    drafter.rollback(0)
    drafter.prefill(prompt[:-1])
    first = drafter.propose(prompt, 4, decoding, None)
    deepest = max(range(len(first.tokens)), key=lambda i: (tree.depths(first.parents)[i], -i))
    path = tree.ancestry(first.parents, deepest)
    assert len(path) >= 3 and drafter._slots[path[1]] != path[1]  # a deep path, cached out of tree order
    seq = prompt + [int(first.tokens[i]) for i in path] + [65]
    drafter.rollback(len(seq) - 1, path)
    again = drafter.propose(seq, 4, decoding, None)
    fresh = ModelDrafter(tiny.draft, spec)
    fresh.rollback(0)
    fresh.prefill(seq[:-1])
    assert again.tokens.tolist() == fresh.propose(seq, 4, decoding, None).tokens.tolist()
    tiny.draft.reset()


# The toy world's draft for dynamic trees: after token a, Q0 rolled as in Q1 but sharper the larger a is, so that
# how many children a node's draws earn depends on which tokens were drawn above it. QD1[0] = Q0.
QD1 = torch.stack([Q0.roll(2 * a) ** (1 + 0.3 * a) for a in range(V)])
QD1 = QD1 / QD1.sum(-1, keepdim=True)


class ToyDraft:
    """The toy world's draft as a Model for ModelDrafter: after token a the next token has law QD1[a] (the text [0]
    puts Q0 at the root). It needs no cache: a row depends on the last token only."""

    device = torch.device("cpu")

    def __init__(self):
        self.length = 0

    def forward(self, tokens, keep=None, tree=None):
        tokens = torch.as_tensor(tokens).view(-1)
        self.length += len(tokens)
        return QD1[tokens].log().float()[-(keep or len(tokens)):]

    def keep(self, start, slots):
        self.length = start + len(slots)

    def rollback(self, length):
        self.length = length


def toy_dynamic_tree(drafter_class, spec, gen):
    """(tokens, parents, q, p) of one dynamic tree 2 deep grown by `drafter_class` in the toy world, sampling."""
    drafter = drafter_class(ToyDraft(), spec)
    draft = drafter.propose([0], 2, Decoding(Sampling(1.0)), gen)
    parents = draft.parents or tree.chain(len(draft.tokens))
    depth = tree.depths(parents)
    p = torch.stack([P0] + [P1[int(t)] if d == 1 else LEAF for t, d in zip(draft.tokens, depth)])
    return draft.tokens, parents, draft.q, p


def dynamic_first_two(drafter_class, spec, n, seed):
    gen = torch.Generator().manual_seed(seed)
    cats = []
    for _ in range(n):
        tokens, parents, q, p = toy_dynamic_tree(drafter_class, spec, gen)
        path, nxt = tree_accept(p, q, tokens, parents, gen)
        out = [int(tokens[i]) for i in path] + [nxt]
        if len(out) == 1:
            out.append(int(torch.multinomial(P1[out[0]][None], 1, generator=gen)))
        cats.append(out[0] * V + out[1])
    return np.array(cats)


DYNAMIC_TOY_N = 4000


def test_sampled_dynamic_trees_give_the_targets_joint_law_and_draw_scored_ones_do_not():
    """Chi-square of the first two tokens (36 cells) over toy rounds whose trees ModelDrafter grows (budget 5,
    width 3, 2 deep: the root's 3 draws and their 9 children compete for 5 places, and which children win depends on
    the draws above them). Scoring a draw by its slot keeps the law; scoring it by q of the token drawn
    (`DrawScoredDrafter`, EAGLE-2's score) fails, with its power from an independent pilot."""
    spec = tree.Dynamic(5, 3)
    bins = merge_bins(JOINT, DYNAMIC_TOY_N)
    assert chi_square(dynamic_first_two(ModelDrafter, spec, DYNAMIC_TOY_N, 0), JOINT, bins)[2] >= LEVEL
    pilot = dynamic_first_two(DrawScoredDrafter, spec, DYNAMIC_TOY_N, 2)
    assert pilot_power(pilot, JOINT, bins, DYNAMIC_TOY_N) >= POWER_GOAL
    assert chi_square(dynamic_first_two(DrawScoredDrafter, spec, DYNAMIC_TOY_N, 1), JOINT, bins)[2] < LEVEL


@one_thread()
def test_sampled_dynamic_trees_in_the_whole_loop_follow_the_targets_law_of_the_first_tokens(tiny):
    """As the static tree's loop test, with a dynamic tree of 6 nodes, width 3, at most 2 deep: 400 generations'
    first 3 tokens against the target's exact law of its first 3 tokens. It fails when nodes get the q rows of
    their parents' parents (tried); EAGLE-2's draw scoring moves the law too little for 400 runs here (tried: it
    passes), which the toy-world test above catches with power 1.0."""
    sampling = Sampling(1.5)
    prompt = tiny.tokenizer(LOOP_PROMPT).input_ids
    nodes, probs = sequence_law(tiny.target, prompt, 3, sampling, LOOP_N)
    bins = merge_bins(probs, LOOP_N)
    outputs = loop_outputs(tiny.target, ModelDrafter(tiny.draft, tree.Dynamic(6, 3)), prompt, 3, 2, sampling, LOOP_N,
                           0, "dynamic tree loop")
    assert chi_square(categorize(outputs, nodes, 3), probs, bins)[2] >= LEVEL
