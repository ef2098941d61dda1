"""The graph backend: static-cache rollback logic on the CPU (graphs off), CUDA graphs and exactness on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from scipy import stats
from transformers import Qwen2Config, Qwen2ForCausalLM

from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel, ModelError, load_pair, make_model
from spec.models.base import parameter_bytes
from spec.models.graph import SPAN_STEP, GraphModel, unsupported_reason
from spec.models.synthetic import build_tiny
from spec.warps import Sampling, warp

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", device="cpu")


def random_walk(a, b, steps: int, seed: int, max_new: int = 9) -> float:
    """Drive two models through the same forwards and rollbacks; the largest logit difference seen."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(steps):
        n = int(torch.randint(1, max_new + 1, (), generator=gen))
        ids = torch.randint(0, a.vocab, (n,), generator=gen)
        worst = max(worst, float((a.forward(ids).cpu() - b.forward(ids).cpu()).abs().max()))
        back = int(torch.randint(max(1, a.length - n - 2), a.length + 1, (), generator=gen))
        a.rollback(back)
        b.rollback(back)
        assert a.length == b.length == back
    return worst


def test_static_cache_matches_eager_after_rollbacks(pair):
    eager = EagerModel(pair.target.model, pair.target.vocab)
    static = GraphModel(pair.target.model, pair.target.vocab, max_length=2 * SPAN_STEP + 40, graphs=False)
    prompt = torch.randint(0, pair.target.vocab, (SPAN_STEP - 10,), generator=torch.Generator().manual_seed(1))
    # float32, two attention layouts: |dz| <= 2 eps32 S sum_i sqrt(n_i) (prob. bound; S = max sum|W h| = 51; the path's
    # 20 reductions give sum sqrt(n_i) = 127 + 4 sqrt(T)): T = 246: 1.2e-3; T <= 552 (the walk): 1.4e-3
    assert torch.allclose(eager.forward(prompt), static.forward(prompt), rtol=0, atol=1.2e-3)
    # Enough steps to cross a span boundary (attention then reads a longer cache prefix).
    assert random_walk(eager, static, 120, seed=2) < 1.4e-3
    assert static.length > SPAN_STEP
    static.reset()
    eager.reset()
    assert static.length == 0
    # the same bound at T = 7: 2 x 6e-8 x 51 x 138 = 8.4e-4
    assert torch.allclose(eager.forward(prompt[:7], keep=2), static.forward(prompt[:7], keep=2), rtol=0, atol=1e-3)


class _ReplayedStep:
    """A stand-in for a captured CUDA graph of `GraphModel._step` on a CPU: replay runs the step on the static ids
    into the static logits, as the graph would."""

    def __init__(self, model, n: int, span: torch.Tensor):
        self.model, self.span = model, span.shape[0]
        self.ids = torch.zeros(n, dtype=torch.long)
        self.logits = torch.empty(n, model.vocab)

    def replay(self):
        self.logits.copy_(self.model._step(self.ids, self.span))


@pytest.mark.parametrize("graphed", [False, True])
def test_prompts_run_in_chunks_at_the_right_positions(pair, graphed):
    """A prompt longer than the prepared graphs runs in chunks (of 16 through the fused kernels on a GPU): every
    chunk at its own positions, the requested rows returned, the length advanced; with graphs, every chunk replays
    the full chunk's graph, the last one padded with stale ids whose cache entries the next forward overwrites.
    Here `_step` is the layer stack (no Triton on a CPU), so chunked and whole forwards differ only in the products'
    shapes."""
    whole = GraphModel(pair.target.model, pair.target.vocab, max_length=2 * SPAN_STEP + 40, graphs=False)
    chunked = GraphModel(pair.target.model, pair.target.vocab, max_length=2 * SPAN_STEP + 40, graphs=False)
    chunked.fused_tokens = chunked.prefill_chunk = 16
    chunked._step = lambda ids, span, tree=False: chunked._head(chunked._run_body(ids, chunked.spans[span], tree))
    replays = []
    if graphed:
        chunked.graphs = True
        graphs = {}

        def graph(n, span, tree=False):
            replays.append(n)
            graph = graphs.setdefault((n, span.shape[0]), _ReplayedStep(chunked, n, span))
            return graph, graph.ids, graph.logits

        chunked._graph = graph
    prompt = torch.randint(0, whole.vocab, (SPAN_STEP + 10,), generator=torch.Generator().manual_seed(6))
    # float32: 2 eps32 S sum sqrt(n_i) (S = 51, as above) at T = 266: 1.2e-3; the chunks cross a span boundary
    for keep in (None, 1, 20, 17):
        whole.reset(), chunked.reset()
        expected, got = whole.forward(prompt, keep=keep), chunked.forward(prompt, keep=keep)
        assert got.shape == expected.shape and chunked.length == whole.length == len(prompt)
        assert torch.allclose(got, expected, rtol=0, atol=1.2e-3), keep
    assert replays == ([16] * 17 * 4 if graphed else [])  # 266 tokens: 16 full chunks and one padded
    assert random_walk(whole, chunked, 20, seed=3, max_new=40) < 1.4e-3  # and the cache it left is the same text


def test_stale_entries_after_rollback_are_invisible(pair):
    """Two texts that share a prefix leave different entries after it; once rolled back to the prefix, the next
    forward cannot tell them apart. (Same shapes in both, so no matrix-product blocking differs.)"""
    static = GraphModel(pair.target.model, pair.target.vocab, max_length=64, graphs=False)
    base = [5, 6, 7, 8]
    outs = []
    for tail in ([9, 10, 11], [13, 14, 15]):
        static.reset()
        static.forward(base + tail)
        static.rollback(len(base))
        outs.append(static.forward([12]))
    assert torch.equal(outs[0], outs[1])


def test_bounds_and_errors(pair):
    static = GraphModel(pair.target.model, pair.target.vocab, max_length=16, graphs=False)
    assert static.max_length == 16
    with pytest.raises(ValueError, match="at least one"):
        static.forward([])
    with pytest.raises(ValueError, match="exceed the static cache"):
        static.forward(list(range(17)))
    static.forward(list(range(10)))
    with pytest.raises(ValueError, match="roll"):
        static.rollback(11)
    with pytest.raises(ModelError, match="CUDA graphs"):  # timing a forward's replay (the kernel tuner's) needs them
        static.replay_ms(1)
    assert static.length == 10
    with pytest.raises(ModelError, match="CUDA"):
        GraphModel(pair.target.model, pair.target.vocab, graphs=True)
    assert static.weight_bytes() == pair.target.weight_bytes()


def test_fused_weights_share_storage(pair):
    """Fusing q/k/v and gate/up must not copy weights nor change what the transformers model computes."""
    model = pair.draft.model
    eager = EagerModel(model, pair.draft.vocab)
    before = eager.forward(list(range(20)))
    GraphModel(model, pair.draft.vocab, max_length=64, graphs=False)
    eager.reset()
    assert torch.equal(before, eager.forward(list(range(20))))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()


def test_greedy_identity_with_static_backend(pair):
    target = GraphModel(pair.target.model, pair.target.vocab, name="target", max_length=256, graphs=False)
    draft = GraphModel(pair.draft.model, pair.draft.vocab, name="draft", max_length=256, graphs=False)
    prompt = list(range(40, 60))
    plain = generate(pair.target, NoDrafter(), prompt, 40, k=0).tokens
    static_plain = generate(target, NoDrafter(), prompt, 40, k=0).tokens
    result = generate(target, ModelDrafter(draft), prompt, 40, k=4)
    assert static_plain == plain
    assert result.tokens == plain
    assert 0 < result.alpha < 1  # both the accept and the reject paths ran


def test_qwen2_architecture_matches_transformers():
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # the biases path is exercised
    assert unsupported_reason(model) is None
    eager = EagerModel(model)
    static = GraphModel(model, max_length=128, graphs=False)
    # float32, as above with this model's S = 1.3 and T <= 128 (sum sqrt(n_i) = 169): 2 x 6e-8 x 1.3 x 169 = 2.6e-5
    assert random_walk(eager, static, 30, seed=3) < 3e-5


def test_make_model_backends(pair):
    model = pair.target.model
    assert isinstance(make_model(model, pair.target.vocab, "eager", "target"), EagerModel)
    with pytest.raises(ModelError, match="backend"):
        make_model(model, pair.target.vocab, "fast", "target")
    for backend in ("graph", "auto"):  # on a CPU: the static cache, no graphs
        static = make_model(model, pair.target.vocab, backend, "target")
        assert isinstance(static, GraphModel) and not static.graphs and static.quantized is None


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Packed weights go to a cache folder of the test's own, never the user's."""
    from spec.models import quant

    monkeypatch.setattr(quant, "cache_root", lambda: tmp_path)
    return tmp_path


def wide_qwen2() -> Qwen2ForCausalLM:
    """A Qwen2 model (q/k/v biases) whose projections' rows are multiples of 64, so PyTorch's CPU int4 layout joins
    them (the tiny Llama's k/v rows, 32, do not: its q/k/v stay three products)."""
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("which", ["tiny", "qwen2"])
def test_packed_weights_on_a_cpu_compute_what_the_eager_backend_does(private_cache, scheme, which):
    """On a CPU the graph backend's int8 / int4 weights are the eager backend's packed layers (`quantize_model`, one
    cache entry for both), q/k/v and gate/up joined into one product each where the codes join; its attention is the
    eager backend's CPU attention (spec/models/attention.py) over the cached text. PyTorch's CPU kernels sum each
    output over the inputs in one order whatever the other rows, so a joined product computes what the separate ones
    do, and the logits are equal, not close: through prompts, steps, rollbacks and a token tree."""
    from spec import tree
    from spec.models.graph import Side
    from spec.models.quant import QuantLinear

    build = (lambda: build_tiny("target", torch.device("cpu"), torch.float32)) if which == "tiny" else wide_qwen2
    eager = make_model(build(), None, "eager", "target", quant=scheme)
    static = make_model(build(), None, "graph", "target", quant=scheme)
    assert isinstance(static, GraphModel) and static.quantized["scheme"] == scheme
    assert static.quantized["cache"] == "cached"  # the eager load wrote the entry; the graph backend read it
    qkv, gate_up = static.layers[0][1][0], static.layers[0][4][0]
    joined = scheme == "int8" or which == "qwen2"
    assert isinstance(qkv, QuantLinear if joined else Side) and isinstance(gate_up, QuantLinear)
    assert static.weight_bytes() == eager.weight_bytes() < parameter_bytes(build()) / 2
    assert random_walk(eager, static, 40, seed=4) == 0.0
    for model in (eager, static):  # forwards of more than one attention chunk (64 queries)
        model.reset()
    assert torch.equal(eager.forward(list(range(3, 153))), static.forward(list(range(3, 153))))
    assert torch.equal(eager.forward(list(range(20, 90))), static.forward(list(range(20, 90))))
    for model in (eager, static):
        model.reset()
        model.forward(list(range(30, 50)))
    nodes, parents = [7, 9, 11, 13, 15], (-1, -1, 0, 0, 1)
    layout = tree.layout(parents, 0, len(nodes), 20)
    assert torch.equal(eager.forward(nodes, tree=layout), static.forward(nodes, tree=layout))
    for model in (eager, static):
        model.keep(20, [20, 22])  # the path root 7 -> its child 11
    assert torch.equal(eager.forward([3]), static.forward([3]))


def test_a_cpu_cache_grows_with_the_text(private_cache, monkeypatch):
    """On a CPU the static cache starts at DEFAULT_MAX_LENGTH positions and grows as the text does, up to the model's
    context (the eager backend's limit), keeping what it held: a text past its first allocation still gives the
    eager backend's logits, bit for bit with packed weights. The transformers model runs the same attention."""
    from spec.models import graph
    from spec.models.attention import NAME

    monkeypatch.setattr(graph, "DEFAULT_MAX_LENGTH", 256)
    cpu = torch.device("cpu")
    eager = make_model(build_tiny("target", cpu, torch.float32), None, "eager", "target", quant="int8")
    static = make_model(build_tiny("target", cpu, torch.float32), None, "auto", "target", quant="int8")
    assert static.max_length == eager.max_length == 4096 and static.k_all.shape[2] == 256
    assert static.model.config._attn_implementation == NAME
    prompt = list(range(10, 250))
    assert torch.equal(eager.forward(prompt), static.forward(prompt))
    assert random_walk(eager, static, 40, seed=5, max_new=20) == 0.0
    assert static.length > 256 and static.k_all.shape[2] == 512


def test_the_servers_max_model_len_sizes_both_caches(private_cache):
    """`--max-model-len` reaches the graph backend's caches through the server's own flags (`load_from_args` ->
    `load_pair(context=)`): both models hold that many positions, not the model's context (on CUDA, where the cache
    is allocated whole, not DEFAULT_MAX_LENGTH); without it they hold the model's context, as before. Past the
    model's own context it is cut there. The server prepares graphs for at most DEFAULT_MAX_LENGTH positions."""
    from spec.cli import load_from_args
    from spec.serving import cli

    flags = ["--pair", "tiny", "--device", "cpu", "--backend", "graph", "--draft-quant", "none"]
    sized = load_from_args(cli.parse_args([*flags, "--max-model-len", "300"]))
    assert sized.target.max_length == sized.draft.max_length == 300
    whole = load_from_args(cli.parse_args(flags))
    assert whole.target.max_length == whole.target.model.config.max_position_embeddings
    past = load_from_args(cli.parse_args([*flags, "--max-model-len", "100000"]))
    assert past.target.max_length == past.target.model.config.max_position_embeddings


def test_a_model_packed_by_the_eager_backend_is_taken_as_it_is(private_cache):
    """`GraphModel` over a model whose layers are packed already (an eager load's) runs them, unasked."""
    model = build_tiny("target", torch.device("cpu"), torch.float32)
    eager = make_model(model, None, "eager", "target", quant="int4")
    before = eager.forward(list(range(20)))
    static = GraphModel(model, graphs=False)
    assert static.cpu_packed and torch.equal(static.forward(list(range(20))), before)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_identity_with_packed_weights_on_the_static_cache(private_cache, scheme):
    """A packed draft on the graph backend on a CPU, chains and a tree: speculation writes the fp32 target's plain
    text. With a packed target too, both backends write the same texts, plain and speculative: they compute the same
    logits. (Those texts need not be equal to each other here: the packed products round their outputs to bf16, so
    the tiny target's logits tie exactly at one step in 40, 0.0 apart, and a step and a verify may break a tie apart,
    as in docs/exactness.md.)"""
    cpu = torch.device("cpu")
    prompt = list(range(40, 60))
    shapes = (4, (2, 2, 1))  # a chain of 4, a tree of depth 3

    def texts(backend, target_quant):
        target = make_model(build_tiny("target", cpu, torch.float32), None, backend, "target", quant=target_quant)
        draft = make_model(build_tiny("draft", cpu, torch.float32), None, backend, "draft", quant=scheme)
        runs = [generate(target, NoDrafter(), prompt, 40, k=0)]
        for shape in shapes:
            drafter = ModelDrafter(draft) if isinstance(shape, int) else ModelDrafter(draft, shape)
            runs.append(generate(target, drafter, prompt, 40, k=shape if isinstance(shape, int) else len(shape)))
        assert all(0 < run.accepted < run.drafted for run in runs[1:])
        return [run.tokens for run in runs]

    plain, *spec = texts("graph", "none")
    assert spec == [plain] * len(shapes)
    assert texts("graph", scheme) == texts("eager", scheme)


def test_the_whole_loop_on_the_static_cache_on_a_cpu_samples_the_target(private_cache):
    """Sampling through the graph backend on a CPU (`--backend auto` there), int4 draft: the law of the first 3 tokens
    of 400 seeded generations against the target's exact sequence probabilities (computed through the same backend);
    the correct loop passes, the softmax-q bug fails with power >= 0.99 (as test_dist's whole-loop test)."""
    from spec import dist_test as dt

    pair = load_pair("tiny", device="cpu", backend="auto", draft_quant="int4")
    assert isinstance(pair.target, GraphModel) and isinstance(pair.draft, GraphModel)
    checks = {c.variant: c for c in dt.loop_checks(pair, ["softmax-q"], 400, 0, Sampling(1.5))}
    assert checks["correct"].verdict == "pass" and checks["softmax-q"].verdict == "FAIL"
    assert checks["softmax-q"].power >= dt.POWER_GOAL


def test_unsupported_architecture_falls_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported_reason(model)
    assert isinstance(make_model(model, 50, "auto", "target"), EagerModel)
    with pytest.raises(ModelError, match="gpt2"):
        make_model(model, 50, "graph", "target")


# ---- CUDA: graphs, compilation, exactness and the distribution ----------------------------------------------


@pytest.fixture(scope="module")
def cuda_pair():
    return load_pair("tiny", device="cuda")


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_graphs_match_eager_after_rollbacks(cuda_pair, compile):
    eager = EagerModel(cuda_pair.target.model, cuda_pair.target.vocab)
    graph = GraphModel(cuda_pair.target.model, cuda_pair.target.vocab, max_length=2 * SPAN_STEP + 40,
                       compile=compile)
    prompt = torch.randint(0, graph.vocab, (100,), generator=torch.Generator().manual_seed(4)).cuda()
    # float32 as in the CPU test: 2 eps32 S sum sqrt(n_i) with S = 51: T = 100: 1.0e-3; T <= 552 (the walk): 1.4e-3
    assert torch.allclose(eager.forward(prompt), graph.forward(prompt), rtol=0, atol=1.1e-3)  # 100 > 64: no graph
    assert random_walk(eager, graph, 200, seed=5) < 1.4e-3
    assert graph._graphs, "no CUDA graph was captured"


@cuda
def test_cuda_greedy_identity(cuda_pair):
    target = make_model(cuda_pair.target.model, cuda_pair.target.vocab, "graph", "target", 512)
    draft = make_model(cuda_pair.draft.model, cuda_pair.draft.vocab, "graph", "draft", 512)
    prompt = list(range(40, 60))
    plain = generate(cuda_pair.target, NoDrafter("cuda"), prompt, 60, k=0).tokens
    assert generate(target, NoDrafter("cuda"), prompt, 60, k=0).tokens == plain
    for k in (1, 4, 8):
        result = generate(target, ModelDrafter(draft), prompt, 60, k=k)
        assert result.tokens == plain
        assert 0 < result.alpha < 1


@cuda
@pytest.mark.parametrize("compile", [None, True])
def test_cuda_fp32_stack_of_a_wide_model_is_exact(compile):
    """fp32 runs the layer stack (no fused kernels): graphed but not compiled by default, compiled when asked. At
    the real 1.5B's width (1536) the compiled stack once raised a ConstraintViolationError on the first prompt (dynamo
    derived a guard on the token count inside the declared range); greedy speculation must equal plain decoding token
    for token, over a prompt longer than any chunk."""
    config = Qwen2Config(vocab_size=512, hidden_size=1536, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to("cuda", torch.float32).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # peaked rows, like a trained model's, so the draft agrees often
        draft_model = Qwen2ForCausalLM(config).to("cuda", torch.float32).eval()
        draft_model.load_state_dict(model.state_dict())
        for p in draft_model.parameters():
            p.data.add_(torch.randn_like(p) * 0.05 * p.std())
    target = make_model(model, 512, "graph", "target", 4096, compile=compile)
    draft = make_model(draft_model, 512, "graph", "draft", 4096, compile=compile)
    assert target.compiled == bool(compile) and not target.fused_step
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(target, NoDrafter("cuda"), prompt, 40, k=0).tokens
    assert generate(EagerModel(model, 512), NoDrafter("cuda"), prompt, 40, k=0).tokens == plain
    assert generate(target, ModelDrafter(draft), prompt, 40, k=4).tokens == plain


@cuda
def test_cuda_sampling_distribution(cuda_pair):
    """Chi-square: with speculation (K = 1) the first token follows the target's warped distribution p."""
    target = make_model(cuda_pair.target.model, cuda_pair.target.vocab, "graph", "target", 128, compile=False)
    draft = make_model(cuda_pair.draft.model, cuda_pair.draft.vocab, "graph", "draft", 128, compile=False)
    sampling = Sampling(temperature=1.0)
    prompt = [256, 10, 20, 30]
    target.reset()
    p = warp(target.forward(prompt)[-1], sampling).cpu().double()
    generator = torch.Generator("cuda").manual_seed(0)
    runs = 3000
    counts = torch.zeros_like(p)
    drafter = ModelDrafter(draft)
    for _ in range(runs):
        first = generate(target, drafter, prompt, 2, k=1, sampling=sampling, generator=generator).tokens[0]
        counts[first] += 1
    expected = p * runs
    common = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    wanted = torch.cat([expected[common], expected[~common].sum()[None]])
    # dist_test's LEVEL: a correct loop fails at 1 seed in 1000
    assert stats.chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue > 1e-3


def test_no_garbage_collection_inside_a_capture(pair, monkeypatch):
    """A dropped model's graphs must not be freed by the collector while another model captures (that invalidates
    the capture): `GraphModel._graph` captures inside `no_collection` (seen here through stand-ins for CUDA's
    graph and stream objects, on a CPU), which holds the collector off inside and restores it after, on an error
    too."""
    import contextlib
    import gc

    from spec.models.graph import no_collection

    seen = []

    class Stand:  # a CUDA stream, or a graph, that does nothing
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def capture(graph, pool=None):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stand)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Stand)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stand())
    monkeypatch.setattr(torch.cuda, "graph", capture)
    model = GraphModel(pair.target.model, pair.target.vocab, max_length=16, graphs=False)
    model.forward([1, 2, 3])
    with torch.no_grad():  # as `forward` calls it
        model._graph(1, model._span(4))
    assert seen == [False] and gc.isenabled()

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_start_time_names_the_backend_that_ran_not_only_the_one_asked(tmp_path, monkeypatch):
    """`--backend auto` picks per model and device, so start_time's JSON says what it picked (as every task's does),
    beside what was asked; each fresh process's row says it too."""
    from spec import start_time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    start_time.main(["--pair", "tiny", "--k", "2", "--context", "64", "--quiet"])
    saved = json.loads(next((tmp_path / "results").glob("start_time-*.json")).read_text())
    assert saved["backend_asked"] == "auto" and saved["backend"] == "graph"  # a Llama on a CPU: the static cache
    assert [row["backend"] for row in saved["rows"]] == ["graph", "graph"]
