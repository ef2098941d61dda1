"""Greedy identity on the real embedded pair (Qwen2.5-Coder 1.5B target, 0.5B draft, bf16 on CPU).

The tiny pair proves the logic; this proves it where the numbers are real bf16 activations of trained models, whose
verify forward over K + 1 tokens and one-token steps take different matmul shapes."""

import pytest
import torch

from spec.drafters import make_drafter
from spec.io import load_prompts
from spec.loop import generate
from spec.models import chat_ids, load_pair
from spec.warps import Sampling

pytestmark = pytest.mark.real
N = 48


@pytest.fixture(scope="module")
def cases(real):
    prompts = [p["prompt"] for p in load_prompts("code")[:2]] + [load_prompts("rename")[0]["prompt"]]
    out = []
    for text in prompts:
        ids = chat_ids(real.tokenizer, text)
        with torch.inference_mode():
            ref = real.target.model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False,
                                             eos_token_id=sorted(real.eos), pad_token_id=real.tokenizer.pad_token_id)
        out.append((ids, ref[0, len(ids):].tolist()))
    return out


def test_plain_decoding_equals_transformers_generate(real, cases):
    for ids, ref in cases[:2]:
        assert generate(real.target, make_drafter("none", real), ids, N, k=0, eos=real.eos).tokens == ref


def test_draft_model_speculation_is_identical(real, cases):
    for ids, ref in cases[:2]:
        result = generate(real.target, make_drafter("draft", real), ids, N, k=4, eos=real.eos)
        assert result.tokens == ref
        assert 0 < result.accepted < result.drafted


def test_prompt_lookup_is_identical_and_finds_the_copied_text(real, cases):
    ids, ref = cases[2]
    result = generate(real.target, make_drafter("lookup", real), ids, N, k=8, eos=real.eos)
    assert result.tokens == ref
    assert result.tokens_per_round > 2  # a rename copies its input: lookup must be finding it


def test_the_real_pairs_cpu_weights_start_on_a_cache_line(real):
    """Both real models load from mapped safetensors files, their weights 32 bytes past a line as read; the
    wrappers move them (spec.models.eager.align_weights), which made the int4 target's step 1.27-1.75x faster."""
    from spec.models.eager import ALIGNMENT

    for wrapped in (real.target, real.draft):
        weights = [t for t in [*wrapped.model.parameters(), *wrapped.model.buffers()] if t.numel()]
        assert weights and all(t.data_ptr() % ALIGNMENT == 0 for t in weights)


def test_the_real_pair_runs_the_grouped_attention_on_a_cpu(real):
    """Qwen2.5's layers take spec/models/attention.py's attention (1.6-1.7x faster one-token steps on 1,200 cached
    tokens than transformers' sdpa); the identity tests in this file then check speculation with it."""
    from spec.models.attention import NAME

    for wrapped in (real.target, real.draft):
        assert wrapped.grouped_attention and wrapped.model.config._attn_implementation == NAME


@pytest.fixture(scope="module")
def real32():
    """The real pair's bf16 weights computed in fp32: the arithmetic of the exactness claims without bf16's rounding
    differences between a step's and a verify's matrix shapes."""
    pair = load_pair("qwen-coder", device="cpu")
    pair.target.model.float()
    pair.draft.model.float()
    return pair


def test_logprobs_equal_plain_decodings_on_the_real_pair(real32):
    ids = chat_ids(real32.tokenizer, load_prompts("code")[0]["prompt"])
    plain = generate(real32.target, make_drafter("none", real32), ids, 8, k=0, logprobs=2, timing=False)
    spec = generate(real32.target, make_drafter("draft", real32), ids, 8, k=4, logprobs=2, timing=False)
    assert spec.tokens == plain.tokens and spec.accepted > 0
    pairs = list(zip((x for r in plain.rounds for x in r.logprobs), (x for r in spec.rounds for x in r.logprobs)))
    assert len(pairs) == 8
    for (lp_a, top_a), (lp_b, top_b) in pairs:
        # fp32 logits of the 1.5B agree to ~1e-6 across shapes (8.6e-7 measured on these tokens); 1e-3 leaves
        # three orders of magnitude for another CPU's summation order, while a wrong row or a warped distribution
        # moves a logprob by more than 0.1.
        assert abs(lp_a - lp_b) <= 1e-3 and [t for t, _ in top_a] == [t for t, _ in top_b]


def test_coupled_sampling_is_the_same_text_with_or_without_speculation(real32):
    """Two seeds: coupled plain decoding and coupled speculation (K = 4, the draft model) write the same tokens."""
    ids = chat_ids(real32.tokenizer, load_prompts("short")[0]["prompt"])
    sampling = Sampling(0.8, top_p=0.95, presence_penalty=0.5, coupled=True)
    for seed in (0, 1):
        plain = generate(real32.target, make_drafter("none", real32), ids, 6, k=0, sampling=sampling, seed=seed)
        spec = generate(real32.target, make_drafter("draft", real32), ids, 6, k=4, sampling=sampling, seed=seed)
        assert spec.tokens == plain.tokens and spec.drafted > 0


def test_a_token_tree_writes_plain_greedy_text_on_the_real_pair(real32):
    """fp32: a 14-node tree (2, 2, 1, 1) through the eager backend's tree mask and cache compaction, token for
    token as plain decoding, with more tokens per target forward than rounds of one."""
    ids = chat_ids(real32.tokenizer, load_prompts("code")[0]["prompt"])
    plain = generate(real32.target, make_drafter("none", real32), ids, 24, k=0, timing=False)
    tree = generate(real32.target, make_drafter("draft", real32, shape=(2, 2, 1, 1)), ids, 24, k=4, timing=False)
    assert tree.tokens == plain.tokens
    assert tree.tokens_per_round > 2 and max(r.drafted for r in tree.rounds) == 14


def test_the_graph_backends_static_cache_writes_plain_greedy_text_on_the_real_pair(real32):
    """fp32, the graph backend's own code on a CPU (static KV cache, its layer stack, the CPU attention under the
    causal or the tree mask, `keep`'s gather over all layers; no CUDA graphs or kernels): plain decoding through it
    equals the eager backend's, and a K = 4 chain and a 16-node tree (2, 1, 1, 1, 1, 1, 1, 1) write that text token
    for token."""
    from spec.drafters import ModelDrafter, NoDrafter
    from spec.models.graph import GraphModel

    def static(model):
        return GraphModel(model.model, model.vocab, max_length=512, graphs=False)

    target, draft = static(real32.target), static(real32.draft)
    ids = chat_ids(real32.tokenizer, load_prompts("code")[1]["prompt"])
    eager = generate(real32.target, make_drafter("none", real32), ids, 24, k=0, timing=False).tokens
    assert generate(target, NoDrafter(), ids, 24, k=0, timing=False).tokens == eager
    assert generate(target, ModelDrafter(draft), ids, 24, k=4, timing=False).tokens == eager
    tree = generate(target, ModelDrafter(draft, (2,) + (1,) * 7), ids, 24, k=8, timing=False)
    assert tree.tokens == eager and max(r.drafted for r in tree.rounds) == 16


def test_the_graph_backend_on_a_cpu_computes_the_eager_backends_int4_logits_on_the_real_pair():
    """int4 target and draft, as `--backend auto` runs them on a CPU: the graph backend's packed layers (the Qwen
    shapes' q/k/v and gate/up joined) over its static cache give the eager backend's logits bit for bit on a real
    prompt, a step and a 3-token forward after it; so its plain text is the eager backend's, and greedy speculation
    through it (K = 4, a tree of 14 nodes) writes that text."""
    from spec.drafters import ModelDrafter, NoDrafter
    from spec.models.graph import GraphModel

    eager = load_pair("qwen-coder", device="cpu", backend="eager", with_draft=False, target_quant="int4")
    graph = load_pair("qwen-coder", device="cpu", backend="auto", draft_quant="int4", target_quant="int4")
    assert isinstance(graph.target, GraphModel) and isinstance(graph.draft, GraphModel)
    ids = chat_ids(graph.tokenizer, load_prompts("code")[2]["prompt"])
    for new in (ids, ids[-1:], ids[-3:]):
        assert torch.equal(eager.target.forward(new), graph.target.forward(new))
    graph.target.reset()
    plain = generate(graph.target, NoDrafter(), ids, 24, k=0, eos=graph.eos, timing=False).tokens
    assert plain == generate(eager.target, NoDrafter(), ids, 24, k=0, eos=graph.eos, timing=False).tokens
    for drafter, k in ((ModelDrafter(graph.draft), 4), (ModelDrafter(graph.draft, (2, 2, 1, 1)), 4)):
        result = generate(graph.target, drafter, ids, 24, k=k, eos=graph.eos, timing=False)
        assert result.tokens == plain and result.accepted > 0
