"""The graph backend: static-cache rollback logic on the CPU (graphs off), CUDA graphs and exactness on a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from scipy import stats

from spec.common import CachedModel, ModelError, load_pair
from spec.drafters import ModelDrafter, NoDrafter
from spec.graph import SPAN_STEP, GraphModel, make_model, unsupported_reason
from spec.loop import generate
from spec.rules import Sampling, warp

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
    eager = CachedModel(pair.target.model, pair.target.vocab)
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
    assert static.length == 10
    with pytest.raises(ModelError, match="CUDA"):
        GraphModel(pair.target.model, pair.target.vocab, graphs=True)
    assert static.weight_bytes() == pair.target.weight_bytes()


def test_fused_weights_share_storage(pair):
    """Fusing q/k/v and gate/up must not copy weights nor change what the transformers model computes."""
    model = pair.draft.model
    eager = CachedModel(model, pair.draft.vocab)
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
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # the biases path is exercised
    assert unsupported_reason(model) is None
    eager = CachedModel(model)
    static = GraphModel(model, max_length=128, graphs=False)
    # float32, as above with this model's S = 1.3 and T <= 128 (sum sqrt(n_i) = 169): 2 x 6e-8 x 1.3 x 169 = 2.6e-5
    assert random_walk(eager, static, 30, seed=3) < 3e-5


def test_make_model_backends(pair):
    model = pair.target.model
    assert isinstance(make_model(model, pair.target.vocab, "eager", "target"), CachedModel)
    assert isinstance(make_model(model, pair.target.vocab, "auto", "target"), CachedModel)  # the model is on CPU
    with pytest.raises(ModelError, match="backend"):
        make_model(model, pair.target.vocab, "fast", "target")
    with pytest.raises(ModelError, match="CUDA"):
        make_model(model, pair.target.vocab, "graph", "target")


def test_unsupported_architecture_falls_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported_reason(model)
    assert isinstance(make_model(model, 50, "auto", "target"), CachedModel)
    with pytest.raises(ModelError, match="gpt2"):
        make_model(model, 50, "graph", "target")


# ---- CUDA: graphs, compilation, exactness and the distribution ----------------------------------------------


@pytest.fixture(scope="module")
def cuda_pair():
    return load_pair("tiny", device="cuda")


@cuda
@pytest.mark.parametrize("compile", [False, True])
def test_graphs_match_eager_after_rollbacks(cuda_pair, compile):
    eager = CachedModel(cuda_pair.target.model, cuda_pair.target.vocab)
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


@cuda
@pytest.mark.parametrize("rows, n, pos, span", [(4, 1, 0, 256), (4, 1, 511, 768), (36, 9, 700, 768),
                                                 (16, 4, 255, 256), (128, 32, 3000, 4096), (300, 75, 10, 256)])
def test_split_attention_matches_reference(rows, n, pos, span):
    """The split-KV kernel against fp32 attention with the same causal rule; its error is no larger than bf16 SDPA's
    own (300 rows: past what one program holds, the op's SDPA fallback)."""
    from spec import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    gen = torch.Generator("cuda").manual_seed(rows + pos)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16()
               for shape in ((8, rows, 128), (8, 4096, 128), (8, 4096, 128)))
    position = torch.tensor(pos, device="cuda")
    got = kernels.decode_attention(q, k, v, position, span, n, 0.09).float()
    reference = kernels.masked_sdpa(q.float(), k.float(), v.float(), position, span, n, 0.09)
    bf16_sdpa = kernels.masked_sdpa(q, k, v, position, span, n, 0.09).float()
    # bf16 output: at most twice SDPA's own error; floor: rounding |o| < 4 to bf16 alone, half an ulp <= 2^-7 = 7.8e-3
    assert (got - reference).abs().max() <= max(2 * (bf16_sdpa - reference).abs().max(), 1e-2)
    if rows <= kernels.MAX_ROWS:  # the kernel itself: nothing past the last visible position may be read
        k[:, pos + n:] = float("nan")
        v[:, pos + n:] = float("nan")
        assert not kernels.decode_attention(q, k, v, position, span, n, 0.09).isnan().any()


@cuda
def test_split_attention_in_the_graph_backend():
    """bf16 graph backend with the split kernel: its logit error against the eager backend, through forwards and
    rollbacks, is of the size SDPA's is; greedy speculation equals plain greedy decoding on it up to bf16 near-ties
    (the issue's rule: a divergence where the top-2 gap is below the measured logit error)."""
    from spec import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    pair = load_pair("tiny", device="cuda", dtype="bfloat16")
    t = pair.target

    def walk(split: bool, fused_step: bool | None = False) -> float:
        graph = GraphModel(t.model, t.vocab, max_length=2 * SPAN_STEP + 40, split_attention=split,
                           fused_step=fused_step)
        assert graph.split_attention == split
        return random_walk(graph, CachedModel(t.model, t.vocab), 100, seed=6)

    # bf16 logits |z| < 32: two roundings may straddle a boundary, one ulp = 2^-3; on top of twice the stack's error
    assert walk(True) <= 2 * walk(False) + 0.125  # the split kernel alone, on the layer stack
    error = walk(True, None)  # the backend's default: the fused kernels too (their own bound is tested below)
    draft = GraphModel(pair.draft.model, pair.draft.vocab, max_length=512, split_attention=True)
    target = GraphModel(t.model, t.vocab, max_length=512, split_attention=True)
    prompt = list(range(40, 60))
    plain = generate(target, NoDrafter("cuda"), prompt, 60, k=0).tokens
    spec = generate(target, ModelDrafter(draft), prompt, 60, k=4).tokens
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if first is not None:  # allowed only at a near-tie: a top-2 gap below the logit error measured above
        target.reset()
        top = target.forward(prompt + plain[:first], keep=1)[-1].topk(2).values
        gap = float(top[0] - top[1])
        # the near-tie bound is the logit error measured above, not a constant
        assert gap < error, f"divergence at token {first}: top-2 gap {gap:.3f} >= measured error {error:.3f}"


def test_fused_step_refuses_layers_it_does_not_know(pair):
    """The fused one-token step runs plain Llama/Qwen2 layers only; others keep the layer stack, and asking for it
    anyway is an error that says why."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec.graph import fused_step_reason

    assert fused_step_reason(small_model("llama", torch.float32, "cpu")) is None
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, mlp_bias=True))
    assert "biases" in fused_step_reason(model)
    assert not GraphModel(model, max_length=32, graphs=False).fused_step  # on a CPU it is off anyway
    with pytest.raises(ModelError, match="biases"):
        GraphModel(model, max_length=32, graphs=False, fused_step=True)
    with pytest.raises(ValueError, match="fused_tokens"):  # the 2-16-token kernels come with the fused step only
        GraphModel(model, max_length=32, graphs=False, fused_tokens=4)


def small_model(arch: str, dtype: torch.dtype, device: str = "cuda"):
    """A two-layer Llama or Qwen2 (with q/k/v biases that matter) whose heads are big enough for the fused kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=300, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape)))
    model = model.to(device, dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharp distributions, like a trained model's
        if arch == "qwen2":
            model.model.layers[0].self_attn.k_proj.bias.normal_()
    return model


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_step_matches_layer_stack(arch):
    """The fused kernels against the layer stack they replace, through forwards and rollbacks (one token a forward,
    then 1-17: every size the fused kernels take, and 17, which goes to the stack between them): within fp32
    rounding in fp32, and in bf16 within twice the layer stack's own error against the eager backend."""
    from spec import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    for dtype in (torch.float32, torch.bfloat16):
        model = small_model(arch, dtype)
        fused = GraphModel(model, max_length=2 * SPAN_STEP + 40, split_attention=True, fused_step=True,
                           fused_tokens=kernels.MAX_FUSED_TOKENS)
        stack = GraphModel(model, max_length=2 * SPAN_STEP + 40, split_attention=False, fused_step=False)
        eager = CachedModel(model)
        assert fused.fused_step and not stack.fused_step
        # Close to a span boundary: the walk crosses it back and forth (attention reads 256 or 512 positions).
        prompt = torch.randint(0, fused.vocab, (SPAN_STEP - 6,), generator=torch.Generator().manual_seed(7)).cuda()

        def walk(a, b, max_new: int) -> float:
            for m in (a, b):
                m.reset()
                m.forward(prompt)
            return random_walk(a, b, 40, seed=8, max_new=max_new)

        for max_new in (1, 17):
            error = walk(fused, stack, max_new)
            if dtype == torch.float32:
                # 2 eps32 S sum sqrt(n_i), S = 18, T <= 552 (sum sqrt(n_i) = 269) = 5.8e-4, within 1e-3
                assert error < 1e-3, (max_new, error)
            else:
                # bf16 logits |z| < 16 (fp64: 7.9): one ulp, 2^-4, for two roundings either side of a boundary
                assert error <= 2 * walk(stack, eager, max_new) + 0.0625, (max_new, error)


INTERPRETED_WALK = """
import torch, sys
sys.path.insert(0, "tests")
from spec.graph import GraphModel, SPAN_STEP
from test_graph import random_walk, small_model
# fp32: 2 eps32 S sum sqrt(n_i), S = 18, T <= 460 (sum 260): 5.6e-4; fp16, fp32 sums: ~20 roundings of 2^-12 on a
# logit's path, sqrt-accumulated, both sides: 2 sqrt(20) 2^-12 x 18 = 0.04
for dtype, bound in ((torch.float32, 6e-4), (torch.float16, 0.05)):
    model = small_model("qwen2", dtype, "cpu")
    fused = GraphModel(model, max_length=2 * SPAN_STEP + 40, graphs=False, split_attention=True, fused_step=True,
                       fused_tokens=16)
    stack = GraphModel(model, max_length=2 * SPAN_STEP + 40, graphs=False, split_attention=False, fused_step=False)
    prompt = torch.randint(0, fused.vocab, (SPAN_STEP - 6,), generator=torch.Generator().manual_seed(7))
    fused.forward(prompt)
    stack.forward(prompt)
    error = random_walk(fused, stack, 12, seed=8, max_new=17)
    assert error < bound, (dtype, error)
    assert fused.length > SPAN_STEP
# The split-KV attention alone, one-pass (a few rows) and with the second combine kernel (a verify's rows).
from spec import kernels
for rows, n, pos, span, dim in ((4, 1, 300, 512, 128), (2, 1, 511, 768, 32), (36, 9, 700, 768, 64)):
    q, k, v = (torch.randn(shape, generator=torch.Generator().manual_seed(rows)) for shape in
               ((3, rows, dim), (3, 1024, dim), (3, 1024, dim)))
    position = torch.tensor(pos)
    got = kernels.decode_attention(q, k, v, position, span, n, 0.1)
    reference = kernels.masked_sdpa(q, k, v, position, span, n, 0.1)
    # fp32: scores' error sqrt(128) eps32 x 0.1 sum|q k| (8) = 5.5e-6 x the spread of v (~1), + P.V's sqrt(709) eps32
    # |v| (~1): ~1e-5 a side, 2e-5 both; 1e-4 leaves 5x
    assert (got - reference).abs().max() < 1e-4, (rows, n)
    assert torch.equal(kernels.decode_attention(q, k, v, position, span, n, 0.1), got)  # its counters reset
print("ok")
"""


def test_fused_kernels_in_tritons_interpreter():
    """Every fused kernel -- the one-token step and the 2-16-token verify, with q/k/v biases -- against the layer
    stack on a CPU, in Triton's interpreter (TRITON_INTERPRET=1, fp32 and fp16; set before Triton defines the
    kernels, hence a fresh process), across a span boundary; and the split-KV attention, one-pass and two-pass,
    against SDPA. Runs wherever Triton is installed, not in CI."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", INTERPRETED_WALK], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900)
    if "converted to Python scalars" in run.stderr:  # Triton 3.6's interpreter under numpy >= 2.4
        pytest.skip("Triton's interpreter does not run with this numpy")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_kernel_tiles_table_and_rule(tmp_path, monkeypatch):
    """Tuned tiles come from the GPU's file first, then the shipped table; other shapes get a rule that keeps a few
    hundred programs; the tuner only proposes tiles whose sizes divide evenly and fit the registers."""
    from spec import kernels, tune_kernels

    assert kernels.gemv_config("add", 4096, 4096) == (8, 512, 4)  # no device: the rule
    assert kernels.gemv_config("qkv", 64, 4096) == (8, 256, 4)
    # 2-16 tokens: (rows, columns, warps, pipeline stages), a table of its own
    assert kernels.gemv_config("add", 4096, 4096, tokens=9) == (32, 256, 2, 6)
    assert kernels.gemv_config("silu_mul", 14336, 4096, tokens=2) == (128, 64, 4, 4)
    # Tiles tuned for bf16 hold twice the bytes in fp32: fewer stages, then fewer columns, until they fit.
    assert kernels.fit_shared_memory((32, 256, 2, 6), 2, 1) == (32, 256, 2, 6)
    assert kernels.fit_shared_memory((32, 256, 2, 6), 4, 1) == (32, 256, 2, 3)
    assert kernels.fit_shared_memory((128, 256, 4, 2), 4, 2) == (128, 64, 4, 2)
    assert kernels.TUNED["NVIDIA H200"][("add", 4096, 4096)] == (8, 512, 8)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = kernels.tuned_path("Some GPU/1")
    assert path.parent == tmp_path / "spark-spec" / "kernels" and "/" not in path.name
    path.parent.mkdir(parents=True)
    path.write_text('{"configs": [{"kind": "add", "n": 4096, "k": 4096, "bn": 2, "block_k": 128, "warps": 4},'
                    ' {"kind": "add_rows", "n": 4096, "k": 4096, "bn": 16, "block_k": 64, "warps": 1, "stages": 3}]}')
    kernels._tuned.cache_clear()
    try:
        assert kernels._tuned("Some GPU/1")[("add", 4096, 4096)] == (2, 128, 4)
        assert kernels._tuned("Some GPU/1")[("add_rows", 4096, 4096)] == (16, 64, 1, 3)
    finally:
        kernels._tuned.cache_clear()
    for kind, n in (("add", 2048), ("silu_mul", 14336), ("qkv", 32), ("logits", 128256)):
        configs = tune_kernels.candidates(kind, n)
        assert configs
        for bn, block_k, warps in configs:
            elems = bn * block_k * (2 if kind in ("qkv", "silu_mul") else 1)
            assert 256 * warps <= elems <= 2048 * warps
            assert kind != "qkv" or bn <= n
        for bn, block_k, warps, stages in tune_kernels.candidates(kind, n, tokens=9):  # tensor-core tiles
            assert bn >= 16 and block_k >= 64 and warps in (1, 2, 4, 8)
            assert stages * bn * block_k * 2 * (2 if kind == "silu_mul" else 1) <= 160 * 1024


def test_bench_engine_refuses_fused_verify_kernels_without_cuda(capsys):
    """`--backends graph-stack` runs Triton kernels; on a CPU it stops with a reason, not inside Triton."""
    from spec import bench_engine

    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    with pytest.raises(SystemExit, match="graph-stack .* needs a CUDA device"):
        bench_engine.main(["--pair", "tiny", "--device", "cpu", "--backends", "graph-stack", "--quiet"])
