"""The graph backend's Triton kernels: split-KV attention and the fused step against references (CUDA), the fused
kernels in Triton's interpreter (CPU), the tile table, and the clear errors where they cannot run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_graph import cuda, random_walk

from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel, ModelError, load_pair
from spec.models.graph import SPAN_STEP, GraphModel


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny", device="cpu")


@cuda
@pytest.mark.parametrize("rows, n, pos, span", [(4, 1, 0, 256), (4, 1, 511, 768), (36, 9, 700, 768),
                                                 (16, 4, 255, 256), (128, 32, 3000, 4096), (300, 75, 10, 256),
                                                 (600, 100, 10, 256)])
@pytest.mark.parametrize("part_rows", [0, 16, 64])
def test_split_attention_matches_reference(rows, n, pos, span, part_rows, monkeypatch):
    """The split-KV kernel against fp32 attention with the same causal rule; its error is no larger than bf16 SDPA's
    own (300 rows: past what one program holds, three programs a chunk; 600: past four, the op's SDPA fallback).
    `part_rows`: every shape's rows in one kernel, runs of chunks a program (`kernels.PART_ROWS`, taken here
    wherever the one-pass combine is not; 0: the two kernels)."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    monkeypatch.setattr(kernels, "PART_ROWS", part_rows)
    monkeypatch.setattr(kernels, "PART_RANGE", (1, kernels.MAX_ROWS * kernels.MAX_ROW_BLOCKS))
    gen = torch.Generator("cuda").manual_seed(rows + pos)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).bfloat16()
               for shape in ((8, rows, 128), (8, 4096, 128), (8, 4096, 128)))
    position = torch.tensor(pos, device="cuda")
    got = kernels.decode_attention(q, k, v, position, span, n, 0.09).float()
    reference = kernels.masked_sdpa(q.float(), k.float(), v.float(), position, span, n, 0.09)
    bf16_sdpa = kernels.masked_sdpa(q, k, v, position, span, n, 0.09).float()
    # bf16 output: at most twice SDPA's own error; floor: rounding |o| < 4 to bf16 alone, half an ulp <= 2^-7 = 7.8e-3
    assert (got - reference).abs().max() <= max(2 * (bf16_sdpa - reference).abs().max(), 1e-2)
    if rows <= kernels.MAX_ROWS * kernels.MAX_ROW_BLOCKS:  # the kernel: nothing past the last visible position is read
        k[:, pos + n:] = float("nan")
        v[:, pos + n:] = float("nan")
        assert not kernels.decode_attention(q, k, v, position, span, n, 0.09).isnan().any()


@cuda
@pytest.mark.parametrize("rows, n, span", [(4, 1, 8192), (20, 5, 32768), (4, 1, 131072), (68, 17, 131072)])
def test_split_attention_over_long_texts(rows, n, span):
    """Spans past the 4,096 positions the graph backend's cache holds by default, up to Llama 3.1's context of
    131,072 (what a server's --max-model-len past 4,096 would need): up to 1,024 chunks of 128 positions a head,
    combined, the text's last tokens at its end. Same bound as above."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    gen = torch.Generator("cuda").manual_seed(span + rows)
    q = torch.randn((8, rows, 128), device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn((8, span, 128), device="cuda", generator=gen).bfloat16() for _ in range(2))
    position = torch.tensor(span - n, device="cuda")
    got = kernels.decode_attention(q, k, v, position, span, n, 0.09).float()
    reference = kernels.masked_sdpa(q.float(), k.float(), v.float(), position, span, n, 0.09)
    bf16_sdpa = kernels.masked_sdpa(q, k, v, position, span, n, 0.09).float()
    assert (got - reference).abs().max() <= max(2 * (bf16_sdpa - reference).abs().max(), 1e-2)


@cuda
def test_graph_backend_past_its_default_cache():
    """A graph backend whose static cache holds more than DEFAULT_MAX_LENGTH positions (`max_length=`): a prompt past
    8,192 tokens and forwards and rollbacks after it, graphed, against the eager backend, within twice the unfused
    layer stack's own error (bf16), as at short lengths."""
    from spec.models import kernels
    from spec.models.graph import DEFAULT_MAX_LENGTH

    if not kernels.available():
        pytest.skip("needs Triton")
    model = small_model("llama", torch.bfloat16)
    model.config.max_position_embeddings = 12_000  # rotary tables for any position (the default rope)
    length = 8_200 + 200  # the walk: 12 forwards of up to 9 tokens, each rolled back by at most its own
    assert length > 2 * DEFAULT_MAX_LENGTH
    prompt = torch.randint(0, 300, (8_200,), generator=torch.Generator().manual_seed(3))

    def error(**options) -> float:
        graph, eager = GraphModel(model, 300, max_length=length, **options), EagerModel(model, 300)
        assert graph.max_length == length
        worst = float((graph.forward(prompt, keep=16).cpu() - eager.forward(prompt, keep=16).cpu()).abs().max())
        return max(worst, random_walk(graph, eager, 12, seed=8))

    stack = error(split_attention=False, fused_step=False)
    assert error() <= 2 * stack + 0.125  # (one bf16 ulp at |z| < 32, as above)


@cuda
def test_split_attention_in_the_graph_backend():
    """bf16 graph backend with the split kernel: its logit error against the eager backend, through forwards and
    rollbacks, is of the size SDPA's is; greedy speculation equals plain greedy decoding on it up to bf16 near-ties
    (the issue's rule: a divergence where the top-2 gap is below the measured logit error)."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    pair = load_pair("tiny", device="cuda", dtype="bfloat16")
    t = pair.target

    def walk(split: bool, fused_step: bool | None = False) -> float:
        graph = GraphModel(t.model, t.vocab, max_length=2 * SPAN_STEP + 40, split_attention=split,
                           fused_step=fused_step)
        assert graph.split_attention == split
        return random_walk(graph, EagerModel(t.model, t.vocab), 100, seed=6)

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

    from spec.models.graph import fused_step_reason

    assert fused_step_reason(small_model("llama", torch.float32, "cpu")) is None
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, mlp_bias=True))
    assert "biases" in fused_step_reason(model)
    assert not GraphModel(model, max_length=32, graphs=False).fused_step  # on a CPU it is off anyway
    with pytest.raises(ModelError, match="biases"):
        GraphModel(model, max_length=32, graphs=False, fused_step=True)
    with pytest.raises(ValueError, match="fused_tokens"):  # the 2-16-token kernels come with the fused step only
        GraphModel(model, max_length=32, graphs=False, fused_tokens=4)


def small_model(arch: str, dtype: torch.dtype, device: str = "cuda", intermediate: int = 192):
    """A two-layer Llama or Qwen2 (with q/k/v biases that matter) whose heads are big enough for the fused kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=300, hidden_size=128, intermediate_size=intermediate, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
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
    """The fused kernels against the layer stack they replace: the prompt's logits at every position (250 tokens,
    which the fused model runs as graphs of 16-token chunks, the last one padded), then forwards and rollbacks (one
    token a forward, then 1-17: every size the fused kernels take, and 17, a prompt-like forward in two chunks): within
    fp32 rounding in fp32, and in bf16 within twice the layer stack's own error against the eager backend."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    for dtype in (torch.float32, torch.bfloat16):
        model = small_model(arch, dtype)
        fused = GraphModel(model, max_length=2 * SPAN_STEP + 40, split_attention=True, fused_step=True,
                           fused_tokens=kernels.MAX_FUSED_TOKENS)
        stack = GraphModel(model, max_length=2 * SPAN_STEP + 40, split_attention=False, fused_step=False)
        eager = EagerModel(model)
        assert fused.fused_step and not stack.fused_step
        # Close to a span boundary: the walk crosses it back and forth (attention reads 256 or 512 positions).
        prompt = torch.randint(0, fused.vocab, (SPAN_STEP - 6,), generator=torch.Generator().manual_seed(7)).cuda()

        def walk(a, b, max_new: int, prompt=prompt) -> float:
            a.reset(), b.reset()
            first = (a.forward(prompt) - b.forward(prompt)).abs().max().item()
            return max(first, random_walk(a, b, 40, seed=8, max_new=max_new))

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
from spec.models.graph import GraphModel, SPAN_STEP
from test_graph import random_walk
from test_kernels import small_model
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
import contextlib
from spec.models import kernels

@contextlib.contextmanager
def nan_scratch():  # every buffer the attention allocates (partial sums, maxima, sums, its output) full of NaN
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *shape, **options: empty(*shape, **options).fill_(float("nan"))
    torch.empty_like = lambda x, **options: empty_like(x, **options).fill_(float("nan"))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
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
    # Chunks past the text (span 768 over 512 slots) store no partial sums, and the combine reads none of them:
    # with every scratch buffer full of NaN the result is the same, bit for bit.
    with nan_scratch():
        assert torch.equal(kernels.decode_attention(q, k, v, position, span, n, 0.1), got), (rows, n)
# More rows than one program holds (a 64-node tree of 4 query heads a K/V head: 256), split over programs: causal,
# and a random tree of 40 tokens x 4 query heads (each sees the text before slot 100, its ancestors and itself).
import random
random.seed(3)
parents = [-1] + [random.randrange(-1, i) for i in range(1, 40)]
seen = []
for i, parent in enumerate(parents):
    seen.append([100 + i] + (seen[parent] if parent >= 0 else []))
for rows, n, tree in ((300, 75, None), (160, 40, torch.tensor(kernels.tree_mask(seen, 100, 140)))):
    q, k, v = (torch.randn(shape, generator=torch.Generator().manual_seed(rows)) for shape in
               ((2, rows, 32), (2, 512, 32), (2, 512, 32)))
    position = torch.tensor(100)
    got = kernels.decode_attention(q, k, v, position, 256, n, 0.1, tree=tree)
    reference = kernels.masked_sdpa(q, k, v, position, 256, n, 0.1, tree)
    assert (got - reference).abs().max() < 1e-4, (rows, n)
    with nan_scratch():  # two programs' rows a chunk, and chunks a row's tree mask hides from it
        assert torch.equal(kernels.decode_attention(q, k, v, position, 256, n, 0.1, tree=tree), got), (rows, n)
# A verify's rows in one kernel (kernels.PART_ROWS), here for every row count: a program's running softmax over a
# run of chunks, the block's last program combining the runs; as many runs as the rule gives, and one (no partial
# sums: the program finishes). A span shorter than the text: slots past it are not read.
parts_rule, part_range, part_rows_rule = kernels.part_layout, kernels.PART_RANGE, kernels.PART_ROWS
kernels.PART_RANGE = (1, kernels.MAX_ROWS * kernels.MAX_ROW_BLOCKS)
for part_rows, parts in ((16, None), (64, None), (16, 1)):
    kernels.PART_ROWS = part_rows
    kernels.part_layout = lambda *a, parts=parts: (parts or parts_rule(*a)[0], parts_rule(*a)[1])
    for rows, n, pos, span, dim, tree in ((36, 9, 700, 768, 64, None), (64, 16, 300, 512, 128, None),
                                          (16, 4, 255, 256, 128, None),
                                          (160, 40, 100, 256, 32, torch.tensor(kernels.tree_mask(seen, 100, 140)))):
        q, k, v = (torch.randn(shape, generator=torch.Generator().manual_seed(rows)) for shape in
                   ((3, rows, dim), (3, 1024, dim), (3, 1024, dim)))
        position = torch.tensor(pos)
        got = kernels.decode_attention(q, k, v, position, span, n, 0.1, tree=tree)
        assert (got - kernels.masked_sdpa(q, k, v, position, span, n, 0.1, tree)).abs().max() < 1e-4, (rows, parts)
        k[:, min(pos + n, span):] = float("nan")  # runs past the text (or span) read nothing, store nothing, and
        v[:, min(pos + n, span):] = float("nan")  # nothing reads them
        with nan_scratch():
            assert torch.equal(kernels.decode_attention(q, k, v, position, span, n, 0.1, tree=tree), got), (rows, parts)
kernels.PART_ROWS, kernels.PART_RANGE, kernels.part_layout = part_rows_rule, part_range, parts_rule
print("ok")
"""


def run_interpreted(script: str) -> None:
    """Run `script` in a fresh process with the kernels in Triton's interpreter (TRITON_INTERPRET must be set before
    Triton defines them): the project first on the path, then whatever the caller's path held (a Triton installed
    apart, say). It must print "ok"; skipped without Triton, or where its interpreter cannot run."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=900)
    if "converted to Python scalars" in run.stderr:  # Triton 3.6's interpreter under numpy >= 2.4
        pytest.skip("Triton's interpreter does not run with this numpy")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_fused_kernels_in_tritons_interpreter():
    """Every fused kernel -- the one-token step and the 2-16-token verify, with q/k/v biases -- against the layer
    stack on a CPU, in Triton's interpreter (TRITON_INTERPRET=1, fp32 and fp16; set before Triton defines the
    kernels, hence a fresh process), across a span boundary; and the split-KV attention, one-pass and two-pass,
    against SDPA. Runs wherever Triton is installed, not in CI."""

    run_interpreted(INTERPRETED_WALK)


def dequantized_copy(model, scheme: str):
    """A copy of `model` whose Linear weights are the ones int8 / int4 codes stand for (in the model's dtype): what
    the fused kernels over packed weights must compute."""
    import copy

    from spec.models.quant import pack_for_kernels

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear):
                w = pack_for_kernels(module.weight, scheme).dequantize().to(module.weight.dtype)
                module.weight = torch.nn.Parameter(w, requires_grad=False)
    return ref


INTERPRETED_QUANT_WALK = """
import sys, torch
sys.path.insert(0, "tests")
from spec.models.graph import GraphModel, SPAN_STEP
from test_graph import random_walk
from test_kernels import dequantized_copy, small_model
# fp32, as the unquantized walk: 2 eps32 S sum sqrt(n_i), S = 18, T <= 100 (sum ~60): 1.3e-4, within 6e-4.
# fp8 is refused on a CPU (it pays only where a GPU reads it); here its codes go through the same kernels anyway.
import spec.models.graph
spec.models.graph.quant_error = lambda *args: None
for scheme in ("int8", "int4", "fp8"):
    model = small_model("qwen2", torch.float32, "cpu")
    stack = GraphModel(dequantized_copy(model, scheme), max_length=2 * SPAN_STEP + 40, graphs=False,
                       split_attention=False, fused_step=False)
    fused = GraphModel(model, max_length=2 * SPAN_STEP + 40, graphs=False, split_attention=True, fused_step=True,
                       fused_tokens=16, quant=scheme)
    prompt = torch.randint(0, fused.vocab, (40,), generator=torch.Generator().manual_seed(7))
    error = (fused.forward(prompt) - stack.forward(prompt)).abs().max().item()
    error = max(error, random_walk(fused, stack, 6, seed=8, max_new=17))
    for token in prompt[:3, None]:  # one-token steps: the walk's random widths need not include 1
        error = max(error, (fused.forward(token) - stack.forward(token)).abs().max().item())
    assert error < 6e-4, (scheme, error)
print("ok")
"""


def test_quantized_fused_kernels_in_tritons_interpreter():
    """The fused kernels over int8, int4 and fp8 codes (the one-token step, 2-17-token forwards, a 40-token prompt in
    chunks) against the layer stack over the weights the codes stand for, in Triton's interpreter (fp32): the
    de-quantisation in registers (int4's nibble order and group offsets, int8's and fp8's row scales after the sum)
    is the arithmetic it claims. Runs wherever Triton is installed, not in CI."""
    run_interpreted(INTERPRETED_QUANT_WALK)


def epilogue_wanted(epilogue: int, y, out, bound, n: int):
    """What a product's epilogue should write from its exact sums y [tokens, rows] (float64) into `out`, and the
    bound on its error from the sums' own: ADD out + y; SILU_MUL SiLU(gate) up, whose error is the gate's times |up|
    (SiLU' <= 1.1) plus the up's times |SiLU(gate)|; else y."""
    import torch

    from spec.models import kernels

    if epilogue == kernels.ADD:
        return out.double() + y, bound
    if epilogue == kernels.SILU_MUL:
        gate, up = y[:, :n], y[:, n:]
        silu = torch.nn.functional.silu(gate)
        return silu * up, 1.1 * bound[:, :n] * up.abs() + bound[:, n:] * silu.abs() + 1e-6
    return y, bound


def check_int4_products(device: str) -> None:
    """The int4 products of one token (the word kernel, `triton_kernels.int4_word_sums`) and of 2-4 tokens
    (`gemv_few`, the same words for every token; 3 tokens padded to 4, the o product's head-major inputs) against
    the weights the codes stand for, in float64, for each epilogue, in tiles of one and of several iterations (64
    inputs a tile over 192: the next tile's prefetch, the groups' addresses past the first tile, the sums across
    tiles), with RMSNorm. Its error bound, per token: each group's sum of (256 + q) x_low and (256 + 16 q) x_high /
    16 over G codes, then the groups' scaled sums over K / G groups and the tile's reductions, is recursive fp32
    summation of terms at most 272 |x| each, so |error| <= u (G + K / G + 8) sum_g |s_g| 272 sum_{k in g} |x_k|
    (u = 2^-24), plus the same for the offsets' z sum(x); the norm's scale multiplies it. SiLU(gate) up carries the
    gate's error times |up| (SiLU' <= 1.1) and the up's times |SiLU(gate)|."""
    import torch

    from spec.models import kernels
    from spec.models.quant import GROUP, pack_for_kernels

    gen = torch.Generator().manual_seed(0)
    cases = ((kernels.ADD, 64, 192, (16, 64, 4)), (kernels.ADD, 48, 128, (16, 1024, 4)),
             (kernels.LOGITS, 300, 192, (16, 64, 4)), (kernels.SILU_MUL, 96, 192, (16, 64, 4)),
             (kernels.SILU_MUL, 96, 128, (8, 256, 4)))
    for (epilogue, n, k, config), tokens in [(case, m) for case in cases for m in (1, 3)] + [(cases[3], 2),
                                                                                              (cases[0], 4)]:
        rows = 2 * n if epilogue == kernels.SILU_MUL else n
        packed = pack_for_kernels(torch.randn(rows, k, generator=gen).to(device), "int4")
        halves = packed.codes.cpu().view(rows, -1, GROUP // 2)  # the weights the codes stand for, in float64
        codes = torch.cat([halves & 15, halves >> 4], -1).double()
        s_, z_ = packed.scales.double().cpu()[..., None], packed.zeros.double().cpu()[..., None]
        w = ((codes - 8) * s_ + z_).view(rows, k)
        x = torch.randn(tokens, k, generator=gen)
        norm = None if epilogue == kernels.ADD else torch.rand(k, generator=gen) + 0.5
        r = 1.0 if norm is None else torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6)
        xn = x.double() * (1.0 if norm is None else norm.double())
        y = (xn @ w.t()) * r
        scales = packed.scales.double().cpu().abs().repeat_interleave(GROUP, 1)
        zeros = packed.zeros.double().cpu().abs().repeat_interleave(GROUP, 1)
        u = 2.0 ** -24
        bound = u * (GROUP + k // GROUP + 8) * (xn.abs() @ (scales * 272 + zeros).t()) * r + 1e-7
        out = torch.randn(tokens, n, generator=gen) if epilogue == kernels.ADD else torch.zeros(tokens, n)
        want, bound = epilogue_wanted(epilogue, y, out, bound, n)
        got = out.to(device)
        head_major = 16 if epilogue == kernels.ADD and tokens > 1 else 0  # the o product reads the attention's output
        inputs = x if not head_major else x.view(tokens, k // 16, 16).transpose(0, 1).contiguous()
        # (SPARK_SPEC_FEW_TOKENS=0 in the environment: the tensor-core kernel in its own tiles instead)
        kind = {kernels.ADD: "add", kernels.SILU_MUL: "silu_mul", kernels.LOGITS: "logits"}[epilogue]
        tiles = config if tokens == 1 else kernels.few_tile(config, tokens, "int4", kind) \
            if tokens <= kernels.MAX_FEW_TOKENS else None
        kernels.gemv(inputs.squeeze(0).to(device), packed, got.squeeze(0), epilogue,
                     None if norm is None else norm.to(device), 1e-6, tiles, head_major)
        error = (got.double().cpu() - want).abs()
        assert (error <= bound).all(), (epilogue, n, k, tiles, tokens, float(error.max()), float(bound.min()))


def a8_reference(x, norm, packed, k: int):
    """What a one-token product over int4 codes with 8-bit inputs (A8, `triton_kernels.int4_word_sums_a8`) computes,
    in float64 from the kernel's own fp32 steps: xn = x * norm (fp32), per group of G its largest magnitude t,
    xq = round(xn * 127 / t) (fp32), then sum_g s_g (t_g / 127) sum(q xq) + (z_g - 8 s_g) sum(xn), times RMSNorm's
    scale. Also each group's weights' magnitudes (for the error bound), and the smallest distance of xn * 127 / t
    to a rounding tie (where the kernel's fp32 product, FMA or approximate division could round the other way)."""
    import torch

    from spec.models.quant import GROUP, inputs_in_8_bits

    rows = packed.codes.shape[0]
    xn = x.float() * (1.0 if norm is None else norm.float())
    groups = xn.view(-1, k // GROUP, GROUP)
    xq, step = inputs_in_8_bits(xn)
    scaled = groups / torch.where(step > 0, step, 1.0)  # (only to see how far from a tie each input rounded)
    tie = (scaled - scaled.floor() - 0.5).abs().min()
    halves = packed.codes.cpu().view(rows, -1, GROUP // 2)
    codes = torch.cat([halves & 15, halves >> 4], -1).double()  # [rows, groups, G]
    s_, z_ = packed.scales.double().cpu(), packed.zeros.double().cpu()  # [rows, groups]
    dots = torch.einsum("rgj,mgj->mrg", codes, xq.double())  # [tokens, rows, groups]
    sums = groups.double().sum(-1)  # [tokens, groups]
    step = step.double()[..., 0]
    y = (s_[None] * step[:, None] * dots + (z_ - 8 * s_)[None] * sums[:, None]).sum(-1)
    r = 1.0 if norm is None else torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6)
    terms = (s_.abs()[None] * step[:, None] * torch.einsum("rgj,mgj->mrg", codes, xq.double().abs())
             + (z_ - 8 * s_).abs()[None] * groups.double().abs().sum(-1)[:, None]).sum(-1)
    return y * r, terms * r, float(tie)


def check_w4a8_products(device: str) -> None:
    """The one-token int4 products with 8-bit inputs (A8: a `w4a8` draft's; `kernels.gemv(a8=True)`) against
    `a8_reference`, every epilogue, RMSNorm, tiles of one and of several iterations (64 inputs a tile over 192: the
    groups' scales and sums across tiles), and the q/k/v product with its rotary embedding against the same over the
    A8 sums. Each group's integer sum is exact; the rest is fp32 arithmetic on at most K / G + 8 terms a row, so
    |error| <= u (K / G + 16) sum_g |terms_g| (u = 2^-24; 8 more for the step's and the scales' roundings, the
    approximate division), which the data keeps away from rounding ties of xn 127 / t (asserted: a tie could round
    one input a whole step the other way). A wrong pairing of codes and inputs, or a byte out of place, is off by
    the size of the products themselves. Then the whole A8 product against float64 over the unrounded inputs:
    within half a step a group, sum_g (t_g / 254) sum |w|, what 8-bit inputs may cost."""
    import torch

    from spec.models import kernels
    from spec.models.quant import GROUP, pack_for_kernels

    gen = torch.Generator().manual_seed(1)
    cases = ((kernels.ADD, 64, 192, (16, 64, 4)), (kernels.ADD, 48, 128, (16, 1024, 4)),
             (kernels.LOGITS, 300, 192, (16, 64, 4)), (kernels.SILU_MUL, 96, 192, (16, 64, 4)),
             (kernels.SILU_MUL, 96, 128, (8, 256, 4)))
    u = 2.0 ** -24
    for epilogue, n, k, config in cases:
        rows = 2 * n if epilogue == kernels.SILU_MUL else n
        packed = pack_for_kernels(torch.randn(rows, k, generator=gen).to(device), "int4")
        x = torch.randn(1, k, generator=gen)
        norm = None if epilogue == kernels.ADD else torch.rand(k, generator=gen) + 0.5
        y, terms, tie = a8_reference(x, norm, packed, k)
        assert tie > 1e-4, f"the test's data sits {tie} from a rounding tie: pick another seed"
        bound = u * (k // GROUP + 16) * terms + 1e-7
        out = torch.randn(1, n, generator=gen) if epilogue == kernels.ADD else torch.zeros(1, n)
        want, bound = epilogue_wanted(epilogue, y, out, bound, n)
        got = out.to(device, copy=True)  # (out stays as it was: the second check adds to it too)
        kernels.gemv(x[0].to(device), packed, got[0], epilogue, None if norm is None else norm.to(device), 1e-6,
                     config, a8=True)
        error = (got.double().cpu() - want).abs()
        assert (error <= bound).all(), (epilogue, n, k, config, float(error.max()), float(bound.min()))
        # what the 8-bit inputs cost against the float64 product over the inputs as they are
        halves = packed.codes.cpu().view(rows, -1, GROUP // 2)
        w = ((torch.cat([halves & 15, halves >> 4], -1).double() - 8) * packed.scales.double().cpu()[..., None]
             + packed.zeros.double().cpu()[..., None])  # [rows, groups, G]
        xn = x.double() * (1.0 if norm is None else norm.double())
        r = 1.0 if norm is None else torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6)
        exact = (xn @ w.reshape(rows, k).t()) * r
        step = xn.view(1, k // GROUP, GROUP).abs().amax(-1) / 127
        half_steps = (w.abs().sum(-1) * step / 2).sum(-1)[None] * r * 1.001 + bound.max()
        exact_want, half_steps = epilogue_wanted(epilogue, exact, out, half_steps, n)
        assert ((got.double().cpu() - exact_want).abs() <= half_steps).all(), (epilogue, n, k, config)


def check_row_scaled_few_products(device: str, schemes=("int8", "fp8")) -> None:
    """`gemv_few` over row-scaled codes (int8, fp8: a scale per row, applied after the sum) for 2, 3 (padded to 4) and
    4 tokens, every epilogue, RMSNorm, the o product's head-major inputs, one tile and several, against float64 over
    the codes' own values. Bound, per token and row: fp32 sums of K products in runs of 16, then across runs and
    tiles, |error| <= u (K + 16) sum_k |s q_k xn_k|, times the norm's scale, plus u |y| for the scale's and the
    norm's multiplies (u = 2^-24); SiLU(gate) up as in `check_int4_products`."""
    import torch

    from spec.models import kernels
    from spec.models.quant import pack_for_kernels

    gen = torch.Generator().manual_seed(1)
    u = 2.0 ** -24
    for scheme in schemes:
        for epilogue, n, k, config in ((kernels.ADD, 48, 256, (8, 64, 4)), (kernels.SILU_MUL, 40, 128, (8, 128, 4)),
                                       (kernels.LOGITS, 100, 96, (16, 32, 4)), (kernels.RAW, 32, 64, (4, 64, 4))):
            for tokens in (2, 3, 4):
                rows = 2 * n if epilogue == kernels.SILU_MUL else n
                packed = pack_for_kernels(torch.randn(rows, k, generator=gen).to(device), scheme)
                w = packed.codes.cpu().double() * packed.scales.cpu().double()[:, None]
                x = torch.randn(tokens, k, generator=gen)
                norm = None if epilogue == kernels.ADD else torch.rand(k, generator=gen) + 0.5
                r = 1.0 if norm is None else torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6)
                xn = x.double() * (1.0 if norm is None else norm.double())
                y = (xn @ w.t()) * r
                bound = u * (k + 16) * (xn.abs() @ w.abs().t()) * r + u * y.abs() + 1e-7
                out = torch.randn(tokens, n, generator=gen) if epilogue == kernels.ADD else torch.zeros(tokens, n)
                want, bound = epilogue_wanted(epilogue, y, out, bound, n)
                head_major = 16 if epilogue == kernels.ADD else 0
                inputs = x if not head_major else x.view(tokens, k // 16, 16).transpose(0, 1).contiguous()
                got = out.to(device)
                tiles = config if tokens <= kernels.MAX_FEW_TOKENS else None
                kernels.gemv(inputs.to(device), packed, got, epilogue, None if norm is None else norm.to(device),
                             1e-6, tiles, head_major)
                error = (got.double().cpu() - want).abs()
                assert (error <= bound).all(), (scheme, epilogue, tokens, float(error.max()), float(bound.min()))


INTERPRETED_FEW_PRODUCTS = """
import sys
sys.path.insert(0, "tests")
import spec.models.quant
spec.models.quant.quant_error = lambda *args: None  # fp8 codes on a CPU: refused for use, run here anyway
from test_kernels import check_row_scaled_few_products
check_row_scaled_few_products("cpu")
print("ok")
"""


def test_row_scaled_few_token_products_in_tritons_interpreter():
    """`gemv_few` over int8 and fp8 codes against float64, in Triton's interpreter: `check_row_scaled_few_products`
    (the interpreted walk's random widths reach only 2 tokens for them)."""
    run_interpreted(INTERPRETED_FEW_PRODUCTS)


@cuda
def test_row_scaled_few_token_products_on_a_gpu():
    """The same on the GPU (fp8 where the GPU reads it)."""
    from spec.models import kernels
    from spec.models.quant import fp8_device

    if not kernels.available():
        pytest.skip("needs Triton")
    check_row_scaled_few_products("cuda", ("int8", "fp8") if fp8_device(torch.device("cuda")) else ("int8",))


def rope_reference(h, g, w, b, cos, sin, pos: int, heads: int, kv: int, dtype):
    """What the q/k/v kernels should write for inputs h [tokens, K] (RMSNorm with weight g, or none), weights w
    (float64 [rows, K]) and bias b (or None): y as the kernels make it (the sum exact here, RMSNorm's scale after it,
    rounded to `dtype`), then the rotary embedding on q and k, each term rounded as transformers rounds it; as
    [q heads, then k, then v, tokens, head size], and the bound: the norm's rsqrt, an ulp of fp32 apart, is at most
    an ulp of the dtype in y, whose rotary terms then move by at most 4 eps (|ya| + |yb|)."""
    tokens, dim = h.shape[0], cos.shape[1]
    x = h.double() * g.double() if g is not None else h.double()
    y = x @ w.t()
    if g is not None:
        y = y * torch.rsqrt(h.double().pow(2).mean(1, keepdim=True) + 1e-6)
    y = y.float() + (b.float() if b is not None else 0.0)
    y = y.to(dtype).float().view(tokens, heads + 2 * kv, 2, dim // 2).transpose(0, 1)
    ya, yb = y[:, :, 0], y[:, :, 1]
    c, s_ = (t[pos: pos + tokens].float().view(tokens, 2, dim // 2) for t in (cos, sin))

    def rounded(t):
        return t.to(dtype).float()

    rot = torch.cat([rounded(rounded(ya * c[:, 0]) + rounded(-yb * s_[:, 0])),
                     rounded(rounded(yb * c[:, 1]) + rounded(ya * s_[:, 1]))], -1)
    want = torch.cat([rot[: heads + kv], torch.cat([ya, yb], -1)[heads + kv:]])
    return want, 4 * torch.finfo(dtype).eps * (ya.abs() + yb.abs()).repeat(1, 1, 2) + 1e-30


def check_w4a8_qkv(device: str, dtypes=(torch.float32,)) -> None:
    """The one-token q/k/v product with its rotary embedding (`qkv_rope`) over int4 codes and 8-bit inputs (a w4a8
    draft's), against `rope_reference`, with and without biases, a program of a quarter head and of half one. The
    codes stand for eighths ((q - 8) / 8 + 1 / 4) and the inputs are integers whose every group of 32 holds one of
    magnitude 127, the RMSNorm weight ones: each group's step is exactly 1, so the 8-bit inputs are the inputs
    themselves and every sum is exact; a byte or a group out of place is off by about |y|."""
    from spec.models import kernels
    from spec.models.quant import GROUP, pack_for_kernels

    for dtype in dtypes:
        for heads, kv, dim, k, bias, config in ((4, 2, 32, 256, True, (4, 256, 4)), (2, 1, 64, 128, False,
                                                                                      (16, 128, 4))):
            gen = torch.Generator().manual_seed(dim)
            rows, cap, pos = (heads + 2 * kv) * dim, 48, 17
            w = (torch.randint(-8, 8, (rows, k), generator=gen) / 8).to(device)
            weight = pack_for_kernels(w, "int4")
            weight.scales.fill_(0.125)
            weight.zeros.fill_(0.25)
            w = weight.dequantize().double().cpu()
            b = (torch.randint(-8, 8, (rows,), generator=gen) / 8).to(dtype) if bias else None
            h = torch.randint(-120, 121, (1, k), generator=gen)
            h.view(-1, GROUP)[:, 0] = 127 * (1 - 2 * torch.randint(0, 2, (k // GROUP,), generator=gen))
            h = h.to(dtype)
            g = torch.ones(k, dtype=dtype)
            angle = torch.arange(cap)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
            cos, sin = (torch.cat([f(angle)] * 2, 1).to(dtype) for f in (torch.cos, torch.sin))
            q = torch.full((heads, 1, dim), float("nan"), dtype=dtype, device=device)
            kc, vc = (torch.full((kv, cap, dim), float("nan"), dtype=dtype, device=device) for _ in "kv")
            on = [t if t is None else t.to(device) for t in (h, g, b, cos, sin)]
            kernels.qkv_rope(on[0][0], on[1], 1e-6, weight, on[2], on[3], on[4], torch.tensor(pos, device=device),
                             q, kc, vc, heads, kv, config=config, a8=True)
            want, bound = rope_reference(h, g, w, b, cos, sin, pos, heads, kv, dtype)
            got = torch.cat([q.cpu(), kc.cpu()[:, pos: pos + 1], vc.cpu()[:, pos: pos + 1]]).float()
            assert ((got - want).abs() <= bound).all(), (str(dtype), heads, dim, float((got - want).abs().max()))


def check_rope_in_product(device: str, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> None:
    """The 2-64-token q/k/v product with its rotary embedding in its epilogue (`kernels.ROPE_IN_PRODUCT`,
    `qkv_rows`) and after it (`rope_rows`): every weight format, with and without biases and RMSNorm, programs of a
    quarter head up to four heads (and a last one half empty), split over the inputs and not, 5-64 tokens.
    - Against PyTorch: the product (float64, rounded as the kernels round), bias, rotary embedding, q head-major and
      k / v in the caches at pos + m. The weights are eighths, the inputs and norm weights small integers, so every
      sum is exact in fp32 in any order (int8's row scale is applied after it); what is left is the norm's rsqrt,
      an ulp of fp32 apart, at most an ulp of the dtype in y, whose rotary terms then move by at most
      4 eps (|ya| + |yb|). A pair routed to the wrong row, half, head or slot is off by about |y|.
    - The two paths against each other, bit for bit (exact sums: any order gives the same y; the rotary's products
      are multiplies the compiler cannot fuse into an add, `product_rn`).
    - Nothing else written: q fully, the caches only at pos..pos + M - 1 (the rest stays NaN)."""
    from spec.models import kernels
    from spec.models.quant import pack_for_kernels

    cases = ((4, 2, 32, 256, 5, True, True, "none", (32, 64, 4, 2), 0),  # a head a program
             (4, 2, 32, 256, 9, False, True, "none", (64, 64, 4, 2), 132),  # two heads, split over the inputs
             (2, 1, 64, 128, 16, True, False, "int8", (16, 64, 4, 2), 132),  # a quarter head
             (3, 1, 16, 256, 33, True, True, "none", (64, 64, 4, 2), 0),  # four heads; the last block half empty
             (2, 2, 32, 256, 64, True, True, "int4", (32, 64, 4, 2), 132))
    rule, sms_rule, plain_rule = kernels.ROPE_IN_PRODUCT, kernels._multiprocessors, kernels.LIBRARY_PLAIN
    kernels.LIBRARY_PLAIN = None  # our kernels at every width
    try:
        for dtype in dtypes:
            for heads, kv, dim, k, tokens, bias, norm, scheme, config, sms in cases:
                kernels._multiprocessors = lambda device, sms=sms: sms
                gen = torch.Generator().manual_seed(tokens)
                rows, cap, pos = (heads + 2 * kv) * dim, 96, 17
                w = (torch.randint(-8, 8, (rows, k), generator=gen) / 8).to(device)
                weight = w.to(dtype) if scheme == "none" else pack_for_kernels(w, scheme)
                if scheme == "int4":  # eighths again: (q - 8) / 8 + 1 / 4
                    weight.scales.fill_(0.125)
                    weight.zeros.fill_(0.25)
                if scheme == "int8":  # codes times their row's scale, exact in float64
                    w = weight.codes.double().cpu() * weight.scales.double().cpu()[:, None]
                else:
                    w = (w if scheme == "none" else weight.dequantize()).double().cpu()
                b = (torch.randint(-8, 8, (rows,), generator=gen) / 8).to(dtype) if bias else None
                h = torch.randint(-4, 5, (tokens, k), generator=gen).to(dtype)
                g = torch.randint(1, 3, (k,), generator=gen).to(dtype)
                angle = torch.arange(cap)[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
                cos, sin = (torch.cat([f(angle)] * 2, 1).to(dtype) for f in (torch.cos, torch.sin))
                outs = []
                for fused in (False, True):
                    kernels.ROPE_IN_PRODUCT = fused
                    q = torch.full((heads, tokens, dim), float("nan"), dtype=dtype, device=device)
                    kc, vc = (torch.full((kv, cap, dim), float("nan"), dtype=dtype, device=device) for _ in "kv")
                    on = [t if t is None else t.to(device) for t in (h, g, b, cos, sin)]
                    kernels.qkv_rope(on[0], on[1] if norm else None, 1e-6, weight, on[2], on[3], on[4],
                                     torch.tensor(pos, device=device), q, kc, vc, heads, kv, config=config,
                                     normed=None if norm else on[0])
                    outs.append([t.cpu() for t in (q, kc, vc)])
                want, bound = rope_reference(h, g if norm else None, w, b, cos, sin, pos, heads, kv, dtype)
                label = (str(dtype), heads, kv, dim, tokens, scheme)
                for q, kc, vc in outs:
                    got = torch.cat([q, kc[:, pos: pos + tokens], vc[:, pos: pos + tokens]]).float()
                    assert ((got - want).abs() <= bound).all(), (label, float((got - want).abs().max()))
                    for cache in (kc, vc):
                        assert cache[:, :pos].isnan().all() and cache[:, pos + tokens:].isnan().all(), label
                for apart, fused in zip(*outs, strict=True):
                    assert torch.equal(apart.nan_to_num(), fused.nan_to_num()), label
    finally:
        kernels.ROPE_IN_PRODUCT, kernels._multiprocessors, kernels.LIBRARY_PLAIN = rule, sms_rule, plain_rule


INTERPRETED_ROPE_IN_PRODUCT = """
import sys
sys.path.insert(0, "tests")
import torch
from test_kernels import check_rope_in_product
check_rope_in_product("cpu", (torch.float32, torch.float16))  # (the interpreter has no bf16 arithmetic)
print("ok")
"""


def test_rope_in_the_qkv_product_in_tritons_interpreter():
    """`check_rope_in_product` in Triton's interpreter: fp32 and fp16."""
    run_interpreted(INTERPRETED_ROPE_IN_PRODUCT)


@cuda
def test_rope_in_the_qkv_product_on_a_gpu():
    """The same on the GPU: fp32 (its CUDA-core sums), fp16 and bf16 (tensor cores)."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    check_rope_in_product("cuda")


INTERPRETED_INT4_PRODUCTS = """
import sys
sys.path.insert(0, "tests")
from test_kernels import check_int4_products
check_int4_products("cpu")
print("ok")
"""


def test_int4_products_over_several_tiles_in_tritons_interpreter():
    """The int4 word kernel's products of one and a few tokens against float64, tiles of one and several
    iterations, in Triton's interpreter (the inline LOP3 replaced by the same masks): `check_int4_products`."""
    run_interpreted(INTERPRETED_INT4_PRODUCTS)


INTERPRETED_W4A8_PRODUCTS = """
import sys
sys.path.insert(0, "tests")
from test_kernels import check_w4a8_products, check_w4a8_qkv
check_w4a8_products("cpu")
check_w4a8_qkv("cpu")
print("ok")
"""


def test_w4a8_products_in_tritons_interpreter():
    """The int4 products with 8-bit inputs (a `w4a8` draft's one-token products) against their float64 reference
    and against the product over the inputs as they are, and its q/k/v product with the rotary embedding, in
    Triton's interpreter (dp4a as four products): `check_w4a8_products`, `check_w4a8_qkv`."""
    run_interpreted(INTERPRETED_W4A8_PRODUCTS)


def skip_without_triton() -> None:
    """Skips the calling test where Triton (and so the fused kernels) is missing."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")


@cuda
def test_int4_products_over_several_tiles_on_a_gpu():
    """The same on the GPU, where the codes become floats through the inline PTX LOP3."""
    skip_without_triton()
    check_int4_products("cuda")


@cuda
def test_w4a8_products_on_a_gpu():
    """The same on the GPU, where dp4a is one instruction; the q/k/v product also in bf16."""
    skip_without_triton()
    check_w4a8_products("cuda")
    check_w4a8_qkv("cuda", (torch.float32, torch.bfloat16))


def check_streamed_products(device: str, schemes=("none", "int8", "int4"), dtypes=(torch.float32,)) -> None:
    """One-token products in fewer programs than row blocks (`triton_kernels.gemv_stream`, kernels.STREAM 3), and in
    as many (a STREAM past the blocks), against a program a block in `gemv`, bit for bit: every epilogue and weight
    format, with and without RMSNorm, more blocks than programs but not a multiple of them (programs of unequal
    blocks; the last block part empty), blocks of one tile (the next block's tile is the one loaded ahead), of one
    tile wider than the inputs and of three (the last a part tile)."""
    from spec.models import kernels
    from spec.models.quant import pack_for_kernels

    gen = torch.Generator().manual_seed(0)
    sms = max(1, kernels._multiprocessors(torch.device(device)))  # (Triton's interpreter: one)
    stream = kernels.STREAM
    try:
        for dtype in dtypes:
            for scheme in schemes:
                for epilogue, k, config, norm in ((kernels.ADD, 160, (8, 64, 4), False),  # a part tile last
                                                  (kernels.ADD, 96, (8, 128, 4), True),  # a tile past the inputs
                                                  (kernels.SILU_MUL, 128, (8, 128, 4), True),
                                                  (kernels.SILU_MUL, 192, (16, 64, 4), False),
                                                  (kernels.LOGITS, 192, (16, 64, 4), True)):
                    n = (4 * sms + 3) * config[0] - config[0] // 2
                    weight = torch.randn(2 * n if epilogue == kernels.SILU_MUL else n, k, generator=gen)
                    weight = weight.to(device, dtype) if scheme == "none" else pack_for_kernels(
                        weight.to(device, dtype), scheme)
                    x = torch.randn(k, generator=gen).to(device, dtype)
                    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(device, dtype) if norm else None
                    start = torch.randn(n, generator=gen).to(device, torch.float32 if epilogue == kernels.LOGITS
                                                             else dtype)
                    outs = []
                    for stream in (0, 3, 10**6):  # gemv; gemv_stream in 3 sms programs, then a block each
                        kernels.STREAM = stream
                        blocks = -(-n // config[0])
                        assert kernels.stream_programs(blocks, x.device) == (3 * sms if stream == 3 else blocks)
                        out = start.clone()
                        kernels.gemv(x, weight, out, epilogue, norm_weight, 1e-6, config)
                        outs.append(out)
                    case = (str(dtype), scheme, epilogue, k, config, norm)
                    assert not torch.equal(outs[0], start), case  # (something was written)
                    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), case
    finally:
        kernels.STREAM = stream


INTERPRETED_STREAMED_PRODUCTS = """
import sys
sys.path.insert(0, "tests")
from test_kernels import check_streamed_products
check_streamed_products("cpu")
print("ok")
"""


def test_streamed_one_token_products_in_tritons_interpreter():
    """`check_streamed_products` in Triton's interpreter (fp32; the int4 words' LOP3 replaced by the same masks)."""
    run_interpreted(INTERPRETED_STREAMED_PRODUCTS)


@cuda
def test_streamed_one_token_products_on_a_gpu():
    """The same on the GPU, in fp32 and bf16, fp8 where the GPU reads it; and a graphed model's step with STREAM 3
    against its step without, through a prompt and forwards of 1-5 tokens with rollbacks: the same logits."""
    from spec.models import kernels
    from spec.models.quant import fp8_device

    skip_without_triton()
    fp8 = ("fp8",) if fp8_device(torch.device("cuda")) else ()
    check_streamed_products("cuda", ("none", "int8", "int4", *fp8), (torch.float32, torch.bfloat16))
    stream = kernels.STREAM
    try:
        for scheme in ("none", "int4"):
            walks = []
            for stream in (0, 3):
                kernels.STREAM = stream  # (int4's gate/up: 512 blocks of 16 rows, more than 3 a multiprocessor)
                model = GraphModel(small_model("llama", torch.bfloat16, intermediate=8192), max_length=200,
                                   quant=scheme)
                gen = torch.Generator().manual_seed(3)
                logits = [model.forward(torch.randint(0, model.vocab, (40,), generator=gen).cuda()).cpu()]
                for _ in range(30):
                    n = int(torch.randint(1, 6, (), generator=gen))
                    logits.append(model.forward(torch.randint(0, model.vocab, (n,), generator=gen).cuda()).cpu())
                    model.rollback(model.length - int(torch.randint(0, n, (), generator=gen)))
                walks.append(torch.cat(logits))
            assert torch.equal(walks[0], walks[1]), scheme
    finally:
        kernels.STREAM = stream


def interpreted_check(name: str) -> str:
    """A script for `run_interpreted` that runs this file's check `name` on the CPU, kernels interpreted."""
    return f'import sys\nsys.path.insert(0, "tests")\nfrom test_kernels import {name}\n{name}("cpu")\nprint("ok")\n'


def own_norm_weights(model, seed: int) -> None:
    """Every RMSNorm of `model` gets weights of its own in [0.5, 1.5) (with all ones, a norm handed to the wrong
    product would change no bit)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.5)


def check_library_products(device: str) -> None:
    """Products of several tokens over int4 weights through PyTorch's int4 kernel (`kernels.library_gemv`, bf16:
    tinygemm on CUDA, the CPU kernel here) against the weights the codes stand for, in float64: each epilogue,
    RMSNorm, the o product's head-major inputs, a head and a gate/up (2 x 44 rows) whose rows are padded to 16; an
    ADD's epilogue also making the next product's normed input (`norm_next`).
    Bound, with u = 2^-8 (bf16): the input rounded once (u |xn|), a weight de-quantised in bf16 ((q - 8) s and the
    offset's sum each rounded: 2u (|q - 8| |s| + |z|)), fp32 sums (K 2^-24, far below u), so 4u sum_k |xn_k|
    (|q - 8| |s| + |z|) for the sums plus u |y| for their rounding; then the epilogue's own roundings, 3u of what it
    writes."""
    import torch

    from spec.models import kernels
    from spec.models.quant import GROUP, pack_for_kernels, with_library_layout

    gen = torch.Generator().manual_seed(4)
    u = 2.0 ** -8
    cases = ((kernels.ADD, 64, 256, 16), (kernels.ADD, 64, 256, 0), (kernels.ADD, 96, 128, 0),
             (kernels.SILU_MUL, 96, 256, 0),
             (kernels.SILU_MUL, 44, 128, 0), (kernels.LOGITS, 300, 128, 0), (kernels.RAW, 48, 128, 0))
    for (epilogue, n, k, head_major), tokens in [(case, m) for case in cases for m in (3, 5)]:
        rows = 2 * n if epilogue == kernels.SILU_MUL else n
        weight = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
        packed = with_library_layout(pack_for_kernels(weight, "int4"))
        halves = packed.codes.cpu().view(rows, -1, GROUP // 2)
        q = torch.cat([halves & 15, halves >> 4], -1).double() - 8
        s_, z_ = packed.scales.double().cpu()[..., None], packed.zeros.double().cpu()[..., None]
        w = (q * s_ + z_).view(rows, k)
        magnitude = (q.abs() * s_.abs() + z_.abs()).view(rows, k)
        x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)
        norm = None if epilogue == kernels.ADD else (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
        xn = x.double()
        if norm is not None:
            xn = xn * torch.rsqrt((xn ** 2).mean(1, keepdim=True) + 1e-6) * norm.double()
        y = xn @ w.t()
        bound = 4 * u * (xn.abs() @ magnitude.t()) + u * y.abs()
        out = (torch.randn(tokens, n, generator=gen).to(torch.bfloat16) if epilogue == kernels.ADD else
               torch.zeros(tokens, n, dtype=torch.bfloat16 if epilogue == kernels.SILU_MUL else torch.float32))
        want, bound = epilogue_wanted(epilogue, y, out, bound, n)
        bound = bound + 3 * u * want.abs() + 1e-6
        got = out.to(device)
        inputs = x if not head_major else x.view(tokens, k // head_major, head_major).transpose(0, 1).contiguous()
        assert kernels.library_product(packed, tokens) or kernels.LIBRARY_TOKENS > tokens
        kernels.library_gemv(inputs.to(device), packed, got, epilogue, None if norm is None else norm.to(device), 1e-6,
                             head_major)
        error = (got.double().cpu() - want).abs()
        assert (error <= bound).all(), (epilogue, n, k, head_major, tokens, float(error.max()), float(bound.min()))
        if epilogue == kernels.ADD:  # the next product's input from the same epilogue: the same sum written, and
            # RMSNorm of it times the next norm's weight, bit for bit what the next product's own input kernel makes
            # of it (`library_inputs`), and within one ulp (2u: Triton's interpreter converts to bf16 by truncation,
            # a GPU to nearest; fp32 sums far below u) of float64. Its eps, 16, is a tenth of the rows' mean square
            # or more (|y| ~ 16 from 256 inputs): one left out or mixed up moves every input by 3 % or more.
            next_norm = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16).to(device)
            again = out.to(device)
            normed = kernels.library_gemv(inputs.to(device), packed, again, epilogue, None, 0.0, head_major,
                                          norm_next=(next_norm, 16.0))
            assert torch.equal(again, got)
            assert normed.shape == (tokens, n) and normed.dtype == torch.bfloat16
            assert torch.equal(normed, kernels.library_inputs(got, n, next_norm, 16.0))
            h = got.double().cpu()
            wanted = h * torch.rsqrt((h ** 2).mean(1, keepdim=True) + 16.0) * next_norm.double().cpu()
            assert ((normed.double().cpu() - wanted).abs() <= 2 * u * wanted.abs() + 1e-6).all()


def test_int4_library_products_in_tritons_interpreter():
    """Several tokens over int4 weights through PyTorch's int4 kernel, our input and epilogue kernels around it in
    Triton's interpreter: `check_library_products`."""
    run_interpreted(interpreted_check("check_library_products"))


@cuda
def test_int4_library_products_on_a_gpu():
    """The same on the GPU, through tinygemm."""
    skip_without_triton()
    check_library_products("cuda")


def check_library_fusion(device: str) -> None:
    """An int4 model's forwards of 3-16 tokens run PyTorch's int4 kernel for its products. With the launches between
    them fused (`kernels.LIBRARY_FUSED`: o's and down's epilogues make the next product's normed input, rope_rows
    reads q/k/v as the library wrote it) and apart: the same logits and caches, bit for bit, as the same arithmetic
    in the same order. Llama and Qwen2 layers, every norm with weights of its own (a norm handed to the wrong product
    shows), every product's inputs a multiple of 128 (all through the library) or down's not (192: it runs our
    kernels, and the next layer's q/k/v norms its own input). CUDA's rule for what the library takes, on any device."""
    import copy

    import spec.models.graph
    from spec.models import kernels
    from spec.models.quant import pack_error

    rule, fused_before = spec.models.graph.library_layout_error, kernels.LIBRARY_FUSED
    spec.models.graph.library_layout_error = lambda w, dtype: rule(w, dtype) or pack_error(w.shape, "int4", w.group,
                                                                                          cuda=True)
    try:
        for arch, intermediate in (("llama", 256), ("qwen2", 256), ("llama", 192)):
            model = small_model(arch, torch.bfloat16, device, intermediate)
            own_norm_weights(model, seed=1)
            prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).to(device)
            runs = {}
            for fused in (True, False):
                kernels.LIBRARY_FUSED = fused
                graphed = GraphModel(copy.deepcopy(model), max_length=2 * SPAN_STEP, quant="int4",
                                     graphs=device == "cuda", split_attention=True, fused_step=True, fused_tokens=16)
                library = [w.library is not None for w in (*graphed.step_weights[0], graphed.head_weight)]
                assert library == [True, True, True, intermediate % 128 == 0, True], library
                logits = [graphed.forward(prompt)]
                for n in (3, 5, 9, 16):
                    logits.append(graphed.forward(prompt[:n]))
                    graphed.rollback(graphed.length - 1)
                runs[fused] = logits, graphed.k_cache[1][:, : graphed.length].clone()
            for a, b in zip(runs[True][0], runs[False][0], strict=True):
                assert torch.equal(a, b), (arch, intermediate, float((a - b).abs().max()))
            assert torch.equal(runs[True][1], runs[False][1])
    finally:
        spec.models.graph.library_layout_error, kernels.LIBRARY_FUSED = rule, fused_before


def test_library_products_fused_between_them_change_no_bit_in_tritons_interpreter():
    """`check_library_fusion` in Triton's interpreter, PyTorch's CPU int4 kernel between our kernels."""
    run_interpreted(interpreted_check("check_library_fusion"))


@cuda
def test_library_products_fused_between_them_change_no_bit_on_a_gpu():
    """`check_library_fusion` on the GPU, through tinygemm, graphed."""
    skip_without_triton()
    check_library_fusion("cuda")


def check_plain_library(device: str) -> None:
    """Products of several tokens over the model's own weights through cuBLAS (`kernels.LIBRARY_PLAIN`: torch.mm
    between our input and epilogue kernels, `library_gemv`) against the same forwards through our tiles, fp32, Llama
    and Qwen2 (q/k/v biases: added after the library's product), every norm with weights of its own: a prompt in
    16-token chunks and chains of 3 / 9 / 16 tokens after it, then a 40-node tree in one forward of the 2-64-token
    kernels (a model with fused_tokens=1, whose prompt runs the layer stack: the tree is not cut into chunks, graphed
    or not). The rule's range (33-64) sends only the tree's products to cuBLAS, 2-64 every forward's but the
    one-token ones; the library is counted to have run (and not at all without the rule). The logits and the caches
    agree within 1e-4: fp32 sums of at most 256 terms in another order (u = 2^-24) moved them by 4e-6 in an ad-hoc
    run in Triton's interpreter, while a product routed wrongly (rows or gate/up halves mixed up, the head-major input
    read token-major, a norm lost) moves them by O(1) (10.8 with one weight's rows rolled)."""
    import copy

    from spec import tree
    from spec.models import kernels

    parents = tuple(-1 if i < 4 else (i - 4) // 3 for i in range(40))  # 4 roots, 3 children each, 40 nodes
    before, library_mm = kernels.LIBRARY_PLAIN, kernels.library_mm
    calls = []
    kernels.library_mm = lambda *args, **kwargs: calls.append(args[0].shape) or library_mm(*args, **kwargs)
    try:
        for arch in ("llama", "qwen2"):
            model = small_model(arch, torch.float32, device, 256)
            own_norm_weights(model, seed=2)
            prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).to(device)
            runs, counts = {}, {}
            for rule in (None, (33, 64), (2, 64)):
                kernels.LIBRARY_PLAIN = rule
                calls.clear()
                chained = GraphModel(copy.deepcopy(model), max_length=2 * SPAN_STEP, graphs=device == "cuda",
                                     split_attention=True, fused_step=True, fused_tokens=16)
                logits = [chained.forward(prompt)]
                for n in (3, 9, 16):
                    logits.append(chained.forward(prompt[:n]))
                    chained.rollback(len(prompt))
                one_pass = GraphModel(copy.deepcopy(model), max_length=2 * SPAN_STEP, graphs=device == "cuda",
                                      compile=False, split_attention=True, fused_step=True, fused_tokens=1)
                one_pass.forward(prompt)
                layout = tree.layout(parents, 0, len(parents), len(prompt), device)
                logits.append(one_pass.forward(prompt[: len(parents)], tree=layout))
                counts[rule] = len(calls)
                runs[rule] = logits, chained.k_cache[1][:, : chained.length].clone(), one_pass.k_cache[1].clone()
            assert counts[None] == 0 and 0 < counts[(33, 64)] < counts[(2, 64)], counts
            for rule in ((33, 64), (2, 64)):
                for a, b in zip(runs[None][0], runs[rule][0], strict=True):
                    assert (a - b).abs().max() < 1e-4, (arch, rule, float((a - b).abs().max()))
                for a, b in zip(runs[None][1:], runs[rule][1:], strict=True):
                    assert (a - b).abs().max() < 1e-4, arch
    finally:
        kernels.LIBRARY_PLAIN, kernels.library_mm = before, library_mm


def test_plain_products_through_cublas_in_tritons_interpreter():
    """`check_plain_library` in Triton's interpreter, PyTorch's CPU product in cuBLAS's place."""
    run_interpreted(interpreted_check("check_plain_library"))


@cuda
def test_plain_products_through_cublas_on_a_gpu():
    """`check_plain_library` on the GPU, through cuBLAS, graphed."""
    skip_without_triton()
    check_plain_library("cuda")


INTERPRETED_SPLIT_PRODUCTS = """
import torch
from spec.models import kernels
from spec.models.quant import pack_for_kernels
g = torch.Generator().manual_seed(3)
kernels.LIBRARY_PLAIN = None  # our tiles at every width (64 tokens would take cuBLAS)
input_splits = kernels.input_splits
splits = lambda device: max(seen, default=1)
seen = []
kernels.input_splits = lambda *args: seen.append(input_splits(*args)) or seen[-1]
# (a bf16 product of <= 16 tokens is split only as kernels.SPLIT_PLAIN says: `split_eligible`)
cases = ((kernels.ADD, "none", 17, False, 4, "none"), (kernels.ADD, "none", 9, False, 1, "none"),
         (kernels.ADD, "none", 9, True, 4, "small"), (kernels.SILU_MUL, "none", 5, True, 4, "all"),
         (kernels.SILU_MUL, "int4", 33, True, 4, "none"),
         (kernels.RAW, "int8", 5, True, 4, "none"), (kernels.LOGITS, "none", 64, True, 4, "none"))
for epilogue, scheme, tokens, norm, split, plain_rule in cases:
    kernels.SPLIT_PLAIN = plain_rule
    rows = 64 * (2 if epilogue == kernels.SILU_MUL else 1)
    weight = torch.randn(rows, 1024, generator=g) / 32
    packed = weight if scheme == "none" else pack_for_kernels(weight, scheme)
    plain = weight if scheme == "none" else packed.dequantize().float()
    x = torch.randn(tokens, 1024, generator=g)
    gain = torch.rand(1024, generator=g) + 0.5
    start = torch.randn(tokens, 64, generator=g)  # ADD adds into it
    eps = 1e-6
    xn = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * gain if norm else x
    y = xn @ plain.t()
    want = torch.nn.functional.silu(y[:, :64]) * y[:, 64:] if epilogue == kernels.SILU_MUL else y
    want = start + want if epilogue == kernels.ADD else want
    outs, used = [], []
    for sms in (0, 132):  # unsplit; then 1-2 row blocks on 132 multiprocessors: 4 splits of the 4-16 input tiles
        kernels._multiprocessors = lambda device, sms=sms: sms
        out = start.clone() if epilogue == kernels.ADD else torch.empty(tokens, 64)
        seen.clear()
        kernels.gemv(x, packed, out, epilogue, gain if norm else None, eps)
        outs.append(out)
        used.append(splits(x.device))
    assert used == [1, split], used
    # fp32, any order of a K-term sum: |dy| <= K u S with S = sum |xn w| (u = eps32 / 2), twice between two orders,
    # and RMSNorm's scale (summed in the kernel, applied after) moves y by K u |y| relative; SiLU(g) up then moves
    # by at most (1.1 |up| + |g|) per unit of y; the add into `start` rounds once more (u |want|)
    u = torch.finfo(torch.float32).eps / 2
    big = (xn.abs() @ plain.abs().t()).max() + y.abs().max()
    tol = 2 * 1024 * u * big * (1 + 2 * y.abs().max()) + u * want.abs().max()
    assert (outs[0] - want).abs().max() <= tol, (epilogue, (outs[0] - want).abs().max(), tol)
    assert (outs[1] - outs[0]).abs().max() <= tol, (epilogue, (outs[1] - outs[0]).abs().max(), tol)
    counters = kernels._counters(x.device, kernels._multiprocessors(x.device))
    assert counters.eq(0).all()  # every row block's last split reset its counter
print("ok")
"""


def test_products_split_over_their_inputs_in_tritons_interpreter():
    """A 2-64-token product of few rows, split over its inputs (`input_splits`: each split's partial sums added up
    by the row block's last program, which runs the epilogue), against the same product unsplit and against
    PyTorch, for every epilogue and weight format, with and without RMSNorm, in Triton's interpreter (fp32).
    Runs wherever Triton is installed, not in CI."""
    run_interpreted(INTERPRETED_SPLIT_PRODUCTS)


INTERPRETED_TREE_WALK = """
import sys, torch
sys.path.insert(0, "tests")
from spec import tree
from spec.models.graph import GraphModel, SPAN_STEP
from test_graph_trees import shape_parents
from test_kernels import small_model
# fp32: the fused kernels' tree mask and tree positions against the layer stack's (SDPA with the same mask), on
# trees fed whole (6 and 15 nodes: tiles of 16 tokens; 40 and 64: one fused forward in tiles of 64), grown depth by
# depth over cached siblings (a 1-node frontier runs the one-token kernels), and after `keep` compacted a path;
# bound as the unquantized walk's, 6e-4
for arch in ("llama", "qwen2"):
    model = small_model(arch, torch.float32, "cpu")
    stack = GraphModel(model, max_length=2 * SPAN_STEP, graphs=False, split_attention=False, fused_step=False)
    fused = GraphModel(model, max_length=2 * SPAN_STEP, graphs=False, split_attention=True, fused_step=True,
                       fused_tokens=16)
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(0, 300, (37,), generator=gen).tolist()
    error = 0.0
    for shape in ((2, 2, 1), (3, 2, 1), (4, 3, 2), (8, 7)):
        parents = shape_parents(shape)
        nodes = torch.randint(0, 300, (len(parents),), generator=gen).tolist()
        outs = []
        for m in (stack, fused):
            m.reset()
            m.forward(text, keep=1)
            whole = m.forward(nodes, tree=tree.layout(parents, 0, len(nodes), len(text)))
            m.rollback(len(text))
            width = shape[0]
            grown = [m.forward(nodes[:width], tree=tree.layout(parents, 0, width, len(text)))]
            for node in range(width, len(nodes)):  # one node at a time over its cached siblings
                grown.append(m.forward(nodes[node:node + 1], tree=tree.layout(parents, node, 1, len(text))))
            path = [1, shape[0] + shape[1]] if len(shape) > 1 else [0]
            m.keep(len(text), [len(text) + i for i in path])
            after = m.forward([7, 8, 9])
            outs.append(torch.cat([whole, torch.cat(grown), after]))
        error = max(error, (outs[0] - outs[1]).abs().max().item())
    assert error < 6e-4, (arch, error)
print("ok")
"""


def test_fused_kernels_with_token_trees_in_tritons_interpreter():
    """The fused kernels' token-tree path (the split-KV attention's 64-bit ancestor masks, the rotary rows of the
    tree positions, the one-token step over a tree's slot) against the layer stack with the same trees, in Triton's
    interpreter (fp32): whole trees of 6, 15, 40 and 64 nodes (the last two in one forward of the 2-64-token
    kernels' widest tiles), trees grown one node at a time over cached siblings, and
    the cache after `keep`. Runs wherever Triton is installed, not in CI."""
    run_interpreted(INTERPRETED_TREE_WALK)


FP8_GPU = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                             reason="needs a GPU that reads fp8 (compute capability 8.9+)")


@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["int8", "int4", pytest.param("fp8", marks=FP8_GPU)])
def test_quantized_fused_step_matches_the_weights_it_stands_for(arch, scheme):
    """On the GPU, graphed: the fused kernels over packed codes against the layer stack over the de-quantised
    weights, through the prompt and forwards of 1-17 tokens with rollbacks: within fp32 rounding in fp32; in bf16
    within twice the unquantized fused step's own error against that stack, plus one ulp of a logit."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    for dtype in (torch.float32, torch.bfloat16):
        model = small_model(arch, dtype)
        reference = dequantized_copy(model, scheme)
        fused = GraphModel(model, max_length=2 * SPAN_STEP + 40, quant=scheme)
        plain_fused = GraphModel(dequantized_copy(model, scheme), max_length=2 * SPAN_STEP + 40,
                                 split_attention=True, fused_step=True)
        stack = GraphModel(reference, max_length=2 * SPAN_STEP + 40, split_attention=False, fused_step=False,
                           compile=False)
        assert fused.fused_step and fused.quant == scheme
        prompt = torch.randint(0, fused.vocab, (SPAN_STEP - 6,), generator=torch.Generator().manual_seed(7)).cuda()

        def walk(a, b, prompt=prompt) -> float:
            a.reset(), b.reset()
            first = (a.forward(prompt) - b.forward(prompt)).abs().max().item()
            return max(first, random_walk(a, b, 40, seed=8, max_new=17))

        error = walk(fused, stack)
        if dtype == torch.float32:
            assert error < 1e-3, (scheme, error)
        else:
            assert error <= 2 * walk(plain_fused, stack) + 0.0625, (scheme, error)


@pytest.mark.parametrize("rows", ["24", "8"])
def test_attention_rows_a_program_must_fill_a_tile(rows):
    """SPARK_SPEC_PART_ROWS names the one-kernel attention's rows a program: a tile's, so a power of two of at least
    16 (or 0, off); anything else is refused when the module loads, not left for Triton to fail on a GPU."""
    run = subprocess.run([sys.executable, "-c", "import spec.models.kernels"], capture_output=True, text=True,
                         env=dict(os.environ, SPARK_SPEC_PART_ROWS=rows), cwd=Path(__file__).resolve().parents[1])
    assert run.returncode != 0 and f"SPARK_SPEC_PART_ROWS={rows}: 0 (off) or a power of two" in run.stderr


def test_kernel_tiles_table_and_rule(tmp_path, monkeypatch):
    """Tuned tiles come from the GPU's file first, then the shipped table; other shapes get a rule that keeps a few
    hundred programs; the tuner only proposes tiles whose sizes divide evenly and fit the registers."""
    from spec import tune_kernels
    from spec.models import kernels

    monkeypatch.delenv("SPARK_SPEC_KERNEL_TABLE", raising=False)  # (a shell that measured the rules alone)
    monkeypatch.setattr(kernels, "MAX_FEW_TOKENS", 4)  # (... or sent a few tokens to the tensor cores)
    kernels._tuned.cache_clear()

    assert kernels.gemv_config("add", 4096, 4096) == (8, 512, 8)  # no device: the rule
    assert kernels.gemv_config("qkv", 64, 4096) == (8, 256, 4)
    # Untuned shapes (the Qwen pair's) get tiles inside the tuner's register bound below: a rule that grew the rows
    # with N gave the 1.5B's gate/up 32 x 512 x 2 weights a program, which spilled (16 ms a step, 1.35 without).
    for kind, n, k in (("silu_mul", 8960, 1536), ("add", 1536, 8960), ("add", 1536, 1536), ("logits", 151936, 1536),
                       ("silu_mul", 4864, 896), ("logits", 151936, 896)):
        bn, block_k, warps = kernels.gemv_config(kind, n, k)
        assert 256 * warps <= bn * block_k * (2 if kind == "silu_mul" else 1) <= 2048 * warps, (kind, n, k)
    # 2-16 tokens: (rows, columns, warps, pipeline stages), a table of its own
    assert kernels.gemv_config("add", 4096, 4096, tokens=9) == (32, 256, 2, 6)
    assert kernels.gemv_config("silu_mul", 14336, 4096, tokens=2) == (128, 64, 4, 4)
    # Tiles tuned for bf16 hold twice the bytes in fp32: fewer stages, then fewer columns, until they fit.
    assert kernels.fit_shared_memory((32, 256, 2, 6), 2, 1) == (32, 256, 2, 6)
    assert kernels.fit_shared_memory((32, 256, 2, 6), 4, 1) == (32, 256, 2, 3)
    assert kernels.fit_shared_memory((128, 256, 4, 2), 4, 2) == (128, 64, 4, 2)
    # A tree's 17-64 tokens: tiles of 32 or 64 tokens, 64 rows by 128 columns unless tuned, whose input tiles count in
    # the shared memory.
    assert [kernels.tile_tokens(t) for t in (2, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert kernels.gemv_config("add", 4096, 4096, tokens=40) == kernels.WIDE_TILE  # past 16: the wide tiles
    assert kernels.gemv_config("silu_mul", 14336, 4096, tokens=17) == (64, 128, 4, 2)
    with pytest.raises(ValueError, match="no tiles"):
        kernels.gemv_config("ad", 4096, 4096, tokens=40)
    # packed weights' one-token tiles: the bf16 tile's bytes (int8 twice its columns), but not the head's, which keeps
    # bf16's tile at least PACKED_HEAD_COLUMNS wide (the H200's bf16 head tile is 128 columns); int4's, but q/k/v's,
    # gate/up and the head the word kernel's own tile, at most the inputs' width (a power of two, at least 256)
    assert kernels.gemv_config("add", 4096, 4096, quant="int8") == (8, 1024, 8)
    assert kernels.gemv_config("logits", 128256, 2048, quant="int8") == kernels.gemv_config("logits", 128256, 2048)
    h200_bf16 = {key: tiles for key, tiles in kernels.TUNED["NVIDIA H200"].items() if "@" not in key[0]}
    with kernels.trying({**h200_bf16, ("logits", 151936, 896): (32, 512, 4)}):  # the rule over the H200's bf16 tiles
        assert kernels.gemv_config("logits", 128256, 2048) == (16, 128, 4)  # the H200's bf16 head tile
        for quant in ("int8", "fp8"):
            assert kernels.gemv_config("logits", 128256, 2048, quant=quant) == (16, 256, 4)
        assert kernels.gemv_config("logits", 151936, 896, quant="int8") == (32, 512, 4)  # wide enough already
        for kind, n, k in (("logits", 128256, 2048), ("silu_mul", 8192, 2048)):
            assert kernels.gemv_config(kind, n, k, quant="int4") == kernels.INT4_TILE
        assert kernels.gemv_config("silu_mul", 4864, 896, quant="int4") == (16, 1024, 4)  # Qwen 0.5B: 896 inputs
        assert kernels.gemv_config("logits", 300, 128, quant="int4") == (16, 256, 4)
        assert kernels.gemv_config("add", 2048, 8192, quant="int4") == (8, 4096, 8)  # o, down: bf16's bytes
        assert kernels.gemv_config("qkv", 32, 2048, quant="int4") == (2, 2048, 4)  # q/k/v: the bf16 tile's bytes
        # 5-16 tokens: a packed head keeps the plain width's tiles
        assert kernels.gemv_config("logits", 128256, 4096, tokens=9, quant="int4") == \
            kernels.gemv_config("logits", 128256, 4096, tokens=9)
        # 2-4 tokens over packed weights (gemv_few): the one-token tile, but int4's gate/up and int8's / fp8's
        # head with half its columns
        assert kernels.gemv_config("silu_mul", 8192, 2048, tokens=2, quant="int4") == (16, 512, 4)
        assert kernels.gemv_config("add", 2048, 8192, tokens=4, quant="int4") == (8, 4096, 8)
        assert kernels.gemv_config("logits", 128256, 2048, tokens=2, quant="int4") == \
            kernels.gemv_config("logits", 128256, 2048, quant="int4")
        assert kernels.gemv_config("qkv", 32, 2048, tokens=2, quant="int4") == \
            kernels.gemv_config("qkv", 32, 2048, quant="int4")
        assert kernels.gemv_config("raw", 3072, 2048, tokens=2, quant="int4") == \
            kernels.gemv_config("add", 3072, 2048, quant="int4")
        for quant in ("int8", "fp8"):
            assert kernels.gemv_config("add", 2048, 8192, tokens=3, quant=quant) == \
                kernels.gemv_config("add", 2048, 8192, quant=quant)
            assert kernels.gemv_config("silu_mul", 8192, 2048, tokens=2, quant=quant) == \
                kernels.gemv_config("silu_mul", 8192, 2048, quant=quant)
            assert kernels.few_tile((16, 1024, 4), 4, quant, "logits") == (16, 512, 4)
            assert kernels.few_tile((16, 256, 4), 2, quant, "logits") == (16, kernels.PACKED_HEAD_COLUMNS, 4)
        assert kernels.gemv_config("silu_mul", 8192, 2048, tokens=5, quant="int4") == \
            kernels.gemv_config("silu_mul", 8192, 2048, tokens=5)  # past MAX_FEW_TOKENS: the tensor cores' tiles
    with pytest.raises(ValueError, match="2-4 tokens"):
        kernels.few_tile((16, 1024, 4), 5, "int4", "add")
    assert kernels.fit_shared_memory((16, 256, 2, 6), 2, 1, 64) == (16, 256, 2, 4)  # 6 x 80 x 256 x 2 B > 180 KB
    with pytest.raises(ValueError, match="at most 64"):
        kernels.tile_tokens(65)
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
    # Tree widths and packed weights are tuned apart; where they are not, the plain entry is fitted to them.
    assert [kernels.tuned_kind("add", t, q) for t, q in ((1, "none"), (9, "none"), (17, "none"), (64, "int4"),
                                                          (1, "int8"), (2, "int4"), (2, "none"), (5, "int8"))] == \
        ["add", "add_rows", "add_rows32", "add_rows64@int4", "add@int8", "add_few@int4", "add_rows", "add_rows@int8"]
    path.write_text('{"configs": [{"kind": "add", "n": 4096, "k": 4096, "bn": 2, "block_k": 128, "warps": 4},'
                    ' {"kind": "add_rows", "n": 4096, "k": 4096, "bn": 64, "block_k": 64, "warps": 4, "stages": 3},'
                    ' {"kind": "add_rows64", "n": 4096, "k": 4096, "bn": 32, "block_k": 32, "warps": 8, "stages": 2},'
                    ' {"kind": "add@int4", "n": 4096, "k": 4096, "bn": 4, "block_k": 2048, "warps": 8},'
                    ' {"kind": "add_few@int8", "n": 4096, "k": 4096, "bn": 8, "block_k": 1024, "warps": 4}]}')
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU/1")
    gpu = torch.device("cuda")
    try:
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=40) == (32, 32, 8, 2)  # its own entry
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=20) == kernels.WIDE_TILE  # no 32-wide entry
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=40, quant="int4") == (32, 32, 8, 2)  # plain's
        assert kernels.gemv_config("add", 2048, 2048, gpu, tokens=40, quant="int4") == kernels.WIDE_TILE
        assert kernels.gemv_config("add", 4096, 4096, gpu, quant="int4") == (4, 2048, 8)  # its own entry
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=3, quant="int4") == (4, 2048, 8)  # one token's
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=3, quant="int8") == (8, 1024, 4)  # its own
        assert kernels.gemv_config("add", 4096, 4096, gpu, quant="int8") == (2, 256, 4)  # the bf16 tile's bytes
        assert kernels.gemv_config("add", 4096, 4096, gpu) == (2, 128, 4)
        with kernels.trying({("add_rows64", 4096, 4096): (16, 64, 4, 2)}):  # on trial: before the table
            assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=40) == (16, 64, 4, 2)
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=40) == (32, 32, 8, 2)  # and gone after
        monkeypatch.setenv("SPARK_SPEC_KERNEL_TABLE", "0")  # the rules alone
        kernels._tuned.cache_clear()
        assert kernels.gemv_config("add", 4096, 4096, gpu, tokens=40) == kernels.WIDE_TILE
        assert kernels.gemv_config("add", 4096, 4096, gpu) == (8, 512, 8)
    finally:
        kernels._tuned.cache_clear()
    # The tuner keeps a forward's tiles only where the whole forward gets at least 0.5 % faster with them.
    assert tune_kernels.keep_tuned(9.25, 9.0) and not tune_kernels.keep_tuned(9.25, 9.76)
    assert not tune_kernels.keep_tuned(9.25, 9.24)
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
        for bn, block_k, _warps, stages in tune_kernels.candidates(kind, n, tokens=64):  # a tree's: inputs count
            assert 16 <= bn <= 64 and block_k >= 32 and stages <= 4
            assert stages * (bn * (2 if kind == "silu_mul" else 1) + 64) * block_k * 2 <= 160 * 1024
        assert max(c[1] for c in tune_kernels.candidates(kind, n, tokens=9, quant="int4")) <= 128  # whole groups
        assert tune_kernels.candidates(kind, n, tokens=3, quant="int8") == tune_kernels.candidates(kind, n,
                                                                                                  quant="int8")
        wider = tune_kernels.candidates(kind, n, quant="int4")  # packed: up to 4x the columns of a bf16 tile
        assert set(configs) <= set(wider) and max(c[1] for c in wider) > max(c[1] for c in configs)


class _Kernel:
    """A stand-in for a Triton kernel: records launches and warm-ups (compilations without a launch)."""

    def __init__(self):
        self.launched, self.warmed = [], []

    def __getitem__(self, grid):
        return lambda *args, **options: self.launched.append((grid, args, options))

    def warmup(self, *args, grid, **options):
        self.warmed.append((grid, args, options))


def test_compiling_ahead_compiles_on_a_pool_and_launches_nothing(monkeypatch):
    """Inside `compiling_ahead` every wrapper's kernel is only handed to Triton's AsyncCompileMode (a warm-up, with
    the launch's own arguments and options), outside it is launched; without AsyncCompileMode nothing changes."""
    import types
    from concurrent.futures import ThreadPoolExecutor

    from spec.models import kernels

    modes = []

    class Mode:
        def __init__(self, executor, ignore_errors=False):
            assert isinstance(executor, ThreadPoolExecutor)
            modes.append("made, ignoring errors" if ignore_errors else "made")

        def __enter__(self):
            modes.append("entered")

        def __exit__(self, *exc):
            modes.append("waited")  # the real one waits here for every compilation it started

    kernel = _Kernel()
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(AsyncCompileMode=Mode))
    with kernels.compiling_ahead(workers=2) as ahead:
        assert ahead
        kernels._launch(kernel, (3,), (8, 256, 4, 2), True, "x", 7, NORM=True)
    assert modes == ["made", "entered", "waited"] and not kernel.launched
    options = {"NORM": True, "PDL": True, "num_warps": 4, "launch_pdl": True, "num_stages": 2}
    assert kernel.warmed == [((3,), ("x", 7), options)]
    kernels._launch(kernel, (3,), (8, 256, 4, 2), True, "x", 7, NORM=True)
    assert kernel.launched == kernel.warmed
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace())  # Triton < 3.4
    with kernels.compiling_ahead() as ahead:
        assert not ahead
        kernels._launch(kernel, (3,), (8, 256, 4), False, "x")
    assert len(kernel.launched) == 2 and len(kernel.warmed) == 1
    # The tuner's candidates: one that cannot compile is left for its launch to report, and the mode still ends
    # (Triton's raises on a failed compilation before it clears itself, and the next compiling_ahead would refuse).
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(AsyncCompileMode=Mode))
    with kernels.compiling_ahead(ignore_errors=True):
        pass
    assert modes[-3:] == ["made, ignoring errors", "entered", "waited"]


def test_bench_engine_refuses_fused_verify_kernels_without_cuda(capsys):
    """`--backends graph-stack` runs Triton kernels; on a CPU it stops with a reason, not inside Triton."""
    from spec import bench_engine

    if torch.cuda.is_available():
        pytest.skip("has a CUDA device")
    with pytest.raises(SystemExit, match="graph-stack .* needs a CUDA device"):
        bench_engine.main(["--pair", "tiny", "--device", "cpu", "--backends", "graph-stack", "--quiet"])


@cuda
def test_the_fused_backend_compiles_nothing_and_prepares_its_graphs_ahead(monkeypatch):
    """With the fused kernels the layer stack (prefills only) is not compiled and not graphed, and after
    `prepare` a whole speculative generation captures no new graph: nothing is captured while it is timed."""
    from spec.models import kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    target = GraphModel(small_model("llama", torch.bfloat16), max_length=600)
    draft = GraphModel(small_model("llama", torch.bfloat16), max_length=600)
    assert target.fused_step and not target.compiled and target.graph_tokens == kernels.MAX_FUSED_TOKENS
    ahead = []
    real_run = kernels._run

    def run(kernel, grid, *args, **options):
        ahead.append(kernels._AHEAD.get())
        real_run(kernel, grid, *args, **options)

    monkeypatch.setattr(kernels, "_run", run)
    target.prepare(5, 300)
    draft.prepare(2, 300)
    # graphs of 1-5 tokens and of a prompt's 16-token chunk, at both spans; their kernels compiled in a dry run
    assert {n for n, _, _ in target._graphs} == {1, 2, 3, 4, 5, 16} and {s for _, s, _ in target._graphs} == {256, 512}
    assert not any(tree for *_, tree in target._graphs)  # no tree's graphs without tree_tokens
    import triton

    assert (True in ahead) == hasattr(triton, "AsyncCompileMode") and ahead[-1] is False
    before = (set(target._graphs), set(draft._graphs))
    prompt = torch.randint(0, target.vocab, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    result = generate(target, ModelDrafter(draft), prompt, 60, k=4)
    assert len(result.tokens) == 60 and (set(target._graphs), set(draft._graphs)) == before


def test_input_splits_fill_the_multiprocessors_and_keep_a_tile_each(monkeypatch):
    """The split rule (`input_splits`): products whose row blocks fill the GPU, and CPUs, are not split; the 8B's o
    and down products at a tree's 32 tokens (64 blocks of 64 rows on an H200's 132 multiprocessors) split in two,
    its q/k/v (96 blocks) in four; never more splits than input tiles, never an empty one; the switch turns it off."""
    from spec.models import kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 132 if device.type == "cuda" else 0)
    assert kernels.input_splits(64, 32, torch.device("cpu")) == 1
    assert [kernels.input_splits(blocks, 32, cuda) for blocks in (132, 224, 2004)] == [1, 1, 1]
    assert kernels.input_splits(64, 32, cuda) == 2 and kernels.input_splits(64, 112, cuda) == 2
    assert kernels.input_splits(96, 32, cuda) == 4
    assert kernels.input_splits(16, 3, cuda) == 3 and kernels.input_splits(16, 1, cuda) == 1
    assert kernels.input_splits(32, 5, cuda) == 3  # 4 wanted (32 blocks); 5 tiles as 2 + 2 + 1, not 2 + 2 + 1 + 0
    monkeypatch.setenv("SPARK_SPEC_SPLIT_INPUTS", "0")
    assert kernels.input_splits(64, 32, cuda) == 1


def test_which_products_take_a_library_or_split(monkeypatch):
    """The rules that send a product of several tokens elsewhere: int4 weights with PyTorch's layout to tinygemm from
    LIBRARY_TOKENS tokens; the model's own weights to cuBLAS at LIBRARY_PLAIN's token counts (33-64 by default: a
    tree's verify of more than 32 nodes), read from "lo-hi" or "0"; and which 2-16-token products over the model's
    own weights may split their inputs (SPLIT_PLAIN "small": at most half as many row blocks as multiprocessors)."""
    from spec.models import kernels
    from spec.models.quant import pack_for_kernels

    weight = torch.zeros(64, 256)
    assert kernels.token_range(None, (33, 64)) == (33, 64) and kernels.token_range("0", (33, 64)) is None
    assert kernels.token_range("2-16", None) == (2, 16) and kernels.token_range("9", None) == (9, 9)
    for bad in ("1-64", "64-33", "33-65", "x", "2-x"):  # one-token products never; no empty or unread range
        with pytest.raises(ValueError, match="token counts"):
            kernels.token_range(bad, None)
    monkeypatch.setattr(kernels, "LIBRARY_PLAIN", kernels.token_range(None, (33, kernels.MAX_KERNEL_TOKENS)))
    assert [kernels.library_product(weight, t) for t in (1, 16, 32, 33, 64)] == [False] * 3 + [True] * 2
    with kernels.plain_library(None):
        assert not kernels.library_product(weight, 64)
    assert kernels.library_product(weight, 64)  # restored
    packed = pack_for_kernels(weight, "int8")  # no library layout: ours at every width
    assert not kernels.library_product(packed, 64)
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 132)
    monkeypatch.setattr(kernels, "SPLIT_PLAIN", "small")
    assert [kernels.split_eligible(16, "none", blocks, cuda) for blocks in (32, 64, 66, 67, 96)] == [True] * 3 + [
        False] * 2
    assert kernels.split_eligible(16, "int8", 2000, cuda) and kernels.split_eligible(32, "none", 2000, cuda)
    assert not kernels.split_eligible(16, "fp8", 32, cuda) and kernels.split_eligible(32, "fp8", 32, cuda)
    monkeypatch.setattr(kernels, "SPLIT_PLAIN", "none")
    assert not kernels.split_eligible(16, "none", 32, cuda) and kernels.split_eligible(16, "int4", 32, cuda)
    monkeypatch.setattr(kernels, "SPLIT_PLAIN", "all")
    assert kernels.split_eligible(16, "none", 96, cuda)


@cuda
@pytest.mark.parametrize("scheme, tokens", [("none", 32), ("int4", 9), ("int8", 5)])
def test_split_products_replayed_in_a_graph_are_bitwise_stable(scheme, tokens):
    """A split product (the 1B's o shape: 32-64 row blocks, 2-4 splits on an H100/H200) captured in a CUDA graph
    with PDL and replayed many times: every replay gives the same bits as the first launch whichever split finishes last
    (the partial sums are added in a fixed order), matches the unsplit product, and leaves the counters at zero.
    The interpreter runs programs one at a time; this runs them concurrently."""
    from spec.models import kernels
    from spec.models.quant import pack_for_kernels

    if not kernels.available():
        pytest.skip("needs Triton")
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    weight = (torch.randn(2048, 2048, generator=g, device=device) / 64).to(torch.bfloat16)
    packed = weight if scheme == "none" else pack_for_kernels(weight, scheme)
    x = torch.randn(tokens, 2048, generator=g, device=device).to(torch.bfloat16)
    pdl = kernels.pdl_supported(device)
    blocks = -(-2048 // kernels.gemv_config("raw", 2048, 2048, device, tokens, scheme)[0])
    if blocks >= kernels._multiprocessors(device):
        pytest.skip("this GPU's multiprocessors are fewer than the product's row blocks: nothing to split")
    first = torch.empty(tokens, 2048, dtype=torch.float32, device=device)
    kernels.gemv(x, packed, first, kernels.RAW, pdl=pdl)  # allocates the counters, compiles
    out = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.gemv(x, packed, out, kernels.RAW, pdl=pdl)
    for _ in range(50):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert kernels._counters(device, kernels._multiprocessors(device)).eq(0).all()
    unsplit = torch.empty_like(first)
    os.environ["SPARK_SPEC_SPLIT_INPUTS"] = "0"
    try:
        kernels.gemv(x, packed, unsplit, kernels.RAW, pdl=pdl)
    finally:
        del os.environ["SPARK_SPEC_SPLIT_INPUTS"]
    # bf16 operands, exact products, fp32 sums in two orders: |d| <= 2 K u max sum |x w| (u = eps32 / 2)
    dense = weight if scheme == "none" else packed.dequantize().to(torch.bfloat16)
    bound = (x.float().abs() @ dense.float().abs().t()).max()
    assert (unsplit - first).abs().max() <= 2 * 2048 * torch.finfo(torch.float32).eps / 2 * bound


def test_step_profile_names_each_kernel_by_product_and_counts_its_bytes(monkeypatch):
    """benchmarks/h200/step_profile.py: the kernels of consecutive forwards, in launch order, go to their products
    (the gemv kernels come three a layer, o, gate/up, down, then the head), and a product's bytes are its weights'
    in every layer, attention's the keys and values it reads."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "h200"))
    from step_profile import label, product_bytes

    forward = ["elementwise", "indexSelect", *["qkv_rope", "attention_partial", "gemv", "gemv", "gemv"] * 2, "gemv"]
    one = ["other", "other", *["qkv", "attention", "o", "gate_up", "down"] * 2, "head"]
    assert label(forward * 2, layers=2) == one * 2
    # Several tokens: our tensor-core kernel with the rotary kernel after q/k/v's; the library's kernel (tinygemm)
    # with its input kernel before and its epilogue after (the next norm fused into o's and down's epilogues, so only
    # the first q/k/v and each o gather their input apart).
    tinygemm = "void at::native::(anonymous namespace)::tinygemm_m16n8k16_chunk_kernel<...>"
    rows = ["elementwise", "indexSelect", *["gemv_rows", "rope_rows", "attention_partial", "attention_combine",
                                            "gemv_rows", "gemv_rows", "gemv_rows"] * 2, "gemv_rows"]
    assert label(rows, layers=2) == ["other", "other", *["qkv", "qkv", "attention", "attention", "o", "gate_up",
                                                         "down"] * 2, "head"]
    # ... or with the rotary embedding in the q/k/v product's epilogue (`kernels.ROPE_IN_PRODUCT`) and the
    # attention in one kernel
    fused = ["elementwise", "indexSelect", *["qkv_rows", "attention_parts", "gemv_rows", "gemv_rows",
                                             "gemv_rows"] * 2, "gemv_rows"]
    assert label(fused, layers=2) == ["other", "other", *["qkv", "attention", "o", "gate_up", "down"] * 2, "head"]
    library = ["elementwise", "library_input", tinygemm, "rope_rows", "attention_partial",
               "library_input", tinygemm, "library_output", tinygemm, "library_output", tinygemm, "library_output",
               tinygemm, "rope_rows", "attention_partial",
               "library_input", tinygemm, "library_output", tinygemm, "library_output", tinygemm, "library_output",
               tinygemm, "library_output"]
    assert label(library, layers=2) == ["other", "qkv", "qkv", "qkv", "attention", *["o"] * 3, *["gate_up"] * 2,
                                        *["down"] * 2, "qkv", "qkv", "attention", *["o"] * 3, *["gate_up"] * 2,
                                        *["down"] * 2, "head", "head"]
    model = GraphModel(small_model("llama", torch.float32, "cpu"), max_length=64, graphs=False)
    # 2 layers, hidden 128, 4 heads and 2 K/V heads of 32, intermediate 192, vocab 300, fp32
    assert product_bytes(model, 32) == {"qkv": 2 * 256 * 128 * 4, "o": 2 * 128 * 128 * 4, "gate_up": 2 * 384 * 128 * 4,
                                        "down": 2 * 128 * 192 * 4, "head": 300 * 128 * 4,
                                        "attention": 2 * 2 * 2 * 32 * 32 * 4}


def test_kernel_mix_counts_the_loop_body_of_the_disassembly(monkeypatch):
    """benchmarks/kernel_mix.py's per-weight counts come from the longest backward branch's body: modifiers and
    predicates dropped (uniform ones too, and cuobjdump's encoding comments), the code before and after the loop
    left out, a shorter inner loop not taken for it."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_mix import loop_body

    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   FFMA R5, R4, R4, R5 ;
        /*0040*/               @P1 BRA 0x20 ;
        /*0050*/                   LOP3.LUT R6, R4, 0xf, RZ, 0xc0, !PT ;
        /*0060*/             @!UP0 FADD R7, R6, -8388616 ;                               /* 0xcb00000806077421 */
        /*0070*/                   FFMA R8, R7, R9, R8 ;                                  /* 0x0000000907087223 */
        /*0080*/              @!P2 BRA 0x20 ;
        /*0090*/                   STG.E desc[UR4][R2.64], R8 ;
        /*00a0*/                   EXIT ;
    """
    assert loop_body(sass) == {"LDG": 1, "FFMA": 2, "BRA": 2, "LOP3": 1, "FADD": 1}
    assert loop_body("        /*0000*/                   EXIT ;") == {}


def test_the_rotary_embedding_rounds_each_term_in_sm90s_ptx():
    """The kernels that apply the rotary embedding (`rope_rows`, `qkv_rows`, the one-token `qkv_rope`), compiled for
    an H100/H200 (sm_90) on any machine with Triton: their rotary products are multiplies of their own, rounded, so
    that x cos + rotate_half(x) sin rounds each term as the source (and transformers) does. Left to itself the
    compiler folded the roundings and contracted product and sum into one half-precision FMA (`fma.rn.bf16x2` in
    `rope_rows`, session 27): no half-precision FMA may be left, and `rope_rows`, whose only arithmetic is the
    rotary's, has no FMA at all. `qkv_rows` (with and without RMSNorm, over the model's weights and int8 codes, whose
    row scale it multiplies by before the bias is added) has no FMA beyond those of `gemv_rows`' same main loop:
    none in its epilogue, which `rope_rows` must match bit for bit."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spec.models import triton_kernels as tk

    def ptx(fn, signature: dict, constants: dict, warps: int = 4, stages: int = 1) -> str:
        signature = {**signature, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn, signature, constants)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

    for dt in ("bf16", "fp16", "fp32"):
        half = {name: f"*{dt}" for name in ("b_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr")}
        rope = ptx(tk.rope_rows, {"y_ptr": "*fp32", **half, "pos_ptr": "*i64", "M": "i32", "kv_stride": "i32",
                                  "y_stride": "i32"}, dict(HEADS=4, KV=2, D=32, HAS_BIAS=True, MP=16, PDL=False))
        product = {"x_ptr": f"*{dt}", "nw_ptr": f"*{dt}", "eps": "fp32", "w_ptr": f"*{dt}", "s_ptr": f"*{dt}",
                   "z_ptr": f"*{dt}"}
        scratch = {"part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KSPAN": "i32"}
        for norm, codes in ((True, f"*{dt}"), (False, "*i8")):
            tiles = dict(NORM=norm, BN=64, BLOCK_K=64, MP=16, PDL=False, QUANT=0 if norm else 1, G=32, SPLITS=2,
                         PRECISION="ieee" if dt == "fp32" else "tf32")
            rows = ptx(tk.qkv_rows, {**product, "w_ptr": codes, **half, "pos_ptr": "*i64", **scratch,
                                     "kv_stride": "i32"}, dict(HEADS=4, KV=2, D=32, HAS_BIAS=True, **tiles), stages=2)
            plain = ptx(tk.gemv_rows, {**product, "w_ptr": codes, "out_ptr": "*fp32", **scratch},
                        dict(EPILOGUE=3, XD=0, **tiles), stages=2)
            assert len(re.findall(r"\bfma\.", rows)) == len(re.findall(r"\bfma\.", plain)), (dt, norm)
        one = ptx(tk.qkv_rope, {"h_ptr": f"*{dt}", **{k: v for k, v in product.items() if k != "x_ptr"}, **half,
                                "pos_ptr": "*i64", "K": "i32", "kv_stride": "i32"},
                  dict(HEADS=4, KV=2, D=32, HAS_BIAS=True, BH=2, BLOCK_K=64, PDL=False, QUANT=0, G=32))
        for name, code in (("rope_rows", rope), ("qkv_rows", rows), ("qkv_rope", one)):
            assert re.search(r"\bfma\.rn\.(b?f16)", code) is None, (dt, name)
            assert "mul.rn.f32" in code, (dt, name)
        assert re.search(r"\bfma\.", rope) is None, dt
