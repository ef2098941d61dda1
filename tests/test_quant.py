"""Quantized drafts (spec/models/quant.py): the formats' round-trip bounds, the layers against the weights they stand
for, clear errors, and the answers unchanged: greedy identity and the whole loop's law with int8 and int4 drafts."""

import argparse
import json
import math

import httpx
import pytest
import torch

from spec import dist_test as dt
from spec.cli import add_model_args
from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel, ModelError, chat_ids, load_pair
from spec.models import quant as qz
from spec.models import quant_report as qr
from spec.models.synthetic import build_tiny
from spec.warps import Sampling


def weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows with very different scales, and groups offset far from zero (the hard case for z's rounding)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2
    w[: n // 4] += 3.0  # a quarter of the rows far from zero
    w[0, :] = 0.7  # a constant row: scale ~0, every code the same
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_round_trip_within_half_a_step(dtype):
    w = weights(64, 96, dtype)
    codes, scales = qz.quantize_int8(w)
    assert codes.dtype == torch.int8 and scales.dtype == dtype and codes.abs().max() <= 127
    error = (qz.dequantize_rows(codes, scales) - w.float()).abs()
    # the docstring's bound: |w - q s| <= s / 2 (s rounded up, so no code is clipped); fp32's own product rounding
    # of q s adds |q s| eps32 at most
    bound = scales.float()[:, None] / 2 + w.float().abs() * torch.finfo(torch.float32).eps
    assert (error <= bound).all()
    assert (scales.float() * 127 >= w.float().abs().amax(1)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_round_trip_within_the_derived_bound(dtype):
    w = weights(64, 96, dtype)
    codes, scales = qz.quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == dtype
    assert codes.float().abs().max() <= 448 and (scales.float() * 448 >= w.float().abs().amax(1)).all()
    error = (qz.dequantize_rows(codes, scales) - w.float()).abs()
    # quantize_fp8's bound, max(2^-4 |w|, 2^-10 s), plus fp32's rounding of q s
    s = scales.float()[:, None]
    bound = torch.maximum(2 ** -4 * w.float().abs(), 2 ** -10 * s) + w.float().abs() * torch.finfo(torch.float32).eps
    assert (error <= bound).all()
    assert (error / w.float().abs().clamp(min=1e-6))[1:].max() > 2 ** -6  # not vacuous: errors of that order
    packed = qz.pack_for_kernels(w, "fp8")  # the kernels' layout: the same codes, the int8 arithmetic
    assert torch.equal(packed.dequantize(), qz.dequantize_rows(codes, scales))
    assert qz.KERNEL_FORMATS["fp8"] == qz.KERNEL_FORMATS["int8"]


def test_fp8_runs_only_where_the_gpu_reads_it(monkeypatch):
    assert "compute capability 8.9" in qz.quant_error("--draft-quant", "fp8", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    assert "not on this cuda GPU" in qz.quant_error("--draft-quant", "fp8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100 / H200
    assert qz.quant_error("--draft-quant", "fp8", "cuda") is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_round_trip_within_the_derived_bound(dtype):
    """Min-max (no search): every entry within the derived bound. The search: each group's squared error at most
    min-max's, and on these weights clearly below it in all."""
    w = weights(64, 128, dtype)
    codes, sz = qz.quantize_int4(w, search=False)
    assert sz.shape == (128 // qz.GROUP, 64, 2) and codes.min() >= 0 and codes.max() <= 15
    scale, zero = (sz[..., i].float().t().repeat_interleave(qz.GROUP, 1) for i in (0, 1))  # per entry [N, K]
    u = torch.finfo(dtype).eps / 2
    error = (qz.dequantize_int4(codes, sz) - w.float()).abs()
    # quantize_int4's bound, s / 2 + u (|z| + 8 s), plus fp32 rounding of the de-quantised value (8 eps32 of it)
    bound = scale / 2 + u * (zero.abs() + 8 * scale) + 8 * torch.finfo(torch.float32).eps * (w.float().abs() + 1)
    assert (error <= bound).all()
    assert error[1:].max() > scale[1:].min() / 4  # the bound is not vacuous: the errors are of that size
    searched = (qz.dequantize_int4(*qz.quantize_int4(w)) - w.float()).square()
    by_group = lambda e: e.view(64, -1, qz.GROUP).sum(-1)  # noqa: E731
    assert (by_group(searched) <= by_group(error.square())).all()
    assert searched.sum() < 0.9 * error.square().sum()


def test_int4_search_finds_a_4_bit_grid_that_min_max_misses():
    """Weights that are already 4-bit in groups of 32 (as a Q4_K GGUF's, de-quantised) whose top code goes unused
    (codes 0..14): min-max spreads 16 codes over the range of 15 and rounds nearly every entry; the search finds the
    grid again (its error only the scales' rounding to bf16)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 15, (32, 256), generator=gen).float()
    q[:, ::32], q[:, 1::32] = 0, 14  # each group spans exactly codes 0..14
    s = torch.rand(32, 8, 1, generator=gen) * 0.01 + 0.001
    z = torch.randn(32, 8, 1, generator=gen) * 0.01
    w = ((q.view(32, 8, 32) - 8) * s + z).view(32, 256).to(torch.bfloat16)
    error = {search: (qz.dequantize_int4(*qz.quantize_int4(w, search=search)) - w.float()).square().sum()
             for search in (False, True)}
    assert error[True] < 0.05 * error[False]


def test_the_graph_backends_int4_weights_in_pytorchs_layout_are_the_same_weights():
    """`with_library_layout` lays the fused kernels' int4 codes out again for PyTorch's int4 kernel (the CPU one
    here, tinygemm on CUDA: the same unpacking): its product is x times the weights the codes stand for, rows padded
    to 16 and dropped. Bound, u = 2^-8: x is bf16 already; a weight de-quantised in bf16 at worst, (q - 8) s and
    then + z each rounded, 2u (|q - 8| |s| + |z|); fp32 sums (256 2^-24, below 2^-16 of the same terms); the output
    rounded, u |y|. Only int4 in bf16 has the layout, and products of fewer than LIBRARY_TOKENS tokens keep the
    fused kernels."""
    from spec.models import kernels

    weight = torch.randn(72, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    packed = qz.with_library_layout(qz.pack_for_kernels(weight, "int4"))
    codes, scales_and_zeros = packed.library
    assert scales_and_zeros.shape == (256 // qz.GROUP, 80, 2)  # 72 rows padded to 80
    w = packed.dequantize()
    x = torch.randn(5, 256).to(torch.bfloat16)
    got = qz.int4_library_mm(x, codes, packed.group, scales_and_zeros)
    assert got.shape == (5, 80) and not got[:, 72:].any()
    halves = packed.codes.view(72, -1, qz.GROUP // 2)
    q = torch.cat([halves & 15, halves >> 4], -1).float() - 8
    magnitude = (q.abs() * packed.scales.float().abs()[..., None] + packed.zeros.float().abs()[..., None]).view(72, 256)
    y = x.float() @ w.t()
    bound = (2 * 2 ** -8 + 2 ** -16) * (x.float().abs() @ magnitude.t()) + 2 ** -8 * y.abs()
    assert ((got[:, :72].float() - y).abs() <= bound).all()
    assert packed.nbytes() == qz.pack_for_kernels(weight, "int4").nbytes()  # a product reads one layout
    assert "bfloat16" in qz.library_layout_error(packed, torch.float32)
    assert "int8" in qz.library_layout_error(qz.pack_for_kernels(weight, "int8"), torch.bfloat16)
    assert qz.library_layout_error(packed, torch.bfloat16) is None
    assert [kernels.library_product(packed, m) for m in (1, kernels.LIBRARY_TOKENS - 1, kernels.LIBRARY_TOKENS)] \
        == [False, False, True]
    assert not kernels.library_product(qz.pack_for_kernels(weight, "int4"), 16)
    from spec import tune_kernels  # the tuner times our tiles at every width: it passes the weights without it

    assert tune_kernels.ours(packed).library is None and tune_kernels.ours(packed).codes is packed.codes
    assert not kernels.library_product(tune_kernels.ours(packed), 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_linear_multiplies_by_the_weights_it_stands_for(scheme, dtype):
    """The kernel's product against fp32 x @ W^T of the de-quantised weights (bias included), for one token and
    several, and with output rows that are not a multiple of 16 (the int4 kernel's packing, padded). An fp32
    layer multiplies in bf16 on a CPU (PyTorch's packed kernels are 9-29x slower in fp32) and answers in fp32."""
    linear = torch.nn.Linear(128, 72).to(dtype)
    layer = qz.QuantLinear(linear, scheme)
    assert layer.scales.dtype == torch.bfloat16
    if scheme == "int8":
        w = qz.dequantize_rows(*qz.quantize_int8(linear.weight.detach()))
    else:
        padded = torch.cat([linear.weight.detach(), linear.weight.new_zeros(8, 128)])
        w = qz.dequantize_int4(*qz.quantize_int4(padded))[:72]
    for shape in ((128,), (1, 128), (2, 5, 128)):
        x = torch.randn(shape).to(dtype)
        got = layer(x)
        assert got.shape == (*shape[:-1], 72) and got.dtype == dtype
        got = got.float()
        ref = x.float() @ w.t() + linear.bias.float()
        # bf16 de-quantised weights (2^-8 of each product) and a bf16 output (2^-8 of the sum): 2^-7 sum |x w| + bias;
        # fp32: x and the scales rounded to bf16 (2^-9 each), the sum in fp32: inside the same bound
        bound = 2 ** -7 * (x.float().abs() @ w.abs().t() + linear.bias.float().abs())
        assert ((got - ref).abs() <= bound).all()


def test_errors_name_the_format_and_the_reason():
    assert "fp8" in qz.quant_error("--draft-quant", "fp8", "cpu")
    assert qz.quant_error("--draft-quant", "int4", "cuda") is None  # the graph backend's kernels and tinygemm
    assert "CPU or a CUDA GPU, not on mps" in qz.quant_error("--draft-quant", "int4", "mps")
    assert "bfloat16 only" in qz.eager_quant_error("--draft-quant", "int4", "cuda", torch.float32)
    assert qz.eager_quant_error("--draft-quant", "int8", "cuda", torch.float32) is None
    assert "multiple of 128" in qz.pack_error((64, 192), "int4", cuda=True)  # tinygemm's tiles; 192 = 6 groups
    assert qz.pack_error((64, 192), "int4") is None
    assert "unknown" in qz.quant_error("--draft-quant", "int3", "cpu")
    assert qz.quant_error("--draft-quant", "int4", "cpu") is None and qz.quant_error("x", "none", "cuda") is None
    with pytest.raises(ModelError, match="groups of 32"):
        qz.QuantLinear(torch.nn.Linear(100, 64), "int4")
    with pytest.raises(ModelError, match="fp8"):
        load_pair("tiny", device="cpu", draft_quant="fp8")
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert parser.parse_args(["--draft-quant", "int4"]).draft_quant == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-quant", "int3"])
    # w4a8: a draft's, on CUDA's graph backend only, said before anything loads
    assert parser.parse_args(["--draft-quant", "w4a8"]).draft_quant == "w4a8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target-quant", "w4a8"])
    assert "draft format only" in qz.quant_error("--target-quant", "w4a8", "cuda")
    assert "CUDA kernels, not on a cpu" in qz.quant_error("draft", "w4a8", "cpu")
    assert "graph backend's fused kernels" in qz.eager_quant_error("draft", "w4a8", "cuda", torch.bfloat16)
    assert qz.quant_error("draft", "w4a8", "cuda") is None
    with pytest.raises(ModelError, match="w4a8 runs in the graph backend's CUDA kernels"):
        load_pair("tiny", device="cpu", draft_quant="w4a8")


def test_auto_picks_the_draft_format_measured_fastest_where_the_draft_runs():
    """int4 on a CPU, int8 there when a layer's inputs do not split into groups of 32, int8 in the graph backend's
    fused kernels in half precision, none on any other device; the command line's default, resolved when the draft
    loads."""
    model = build_tiny("draft", torch.device("cpu"), torch.float32)
    assert qz.auto_quant(model, fused_kernels=False)[0] == "int4"
    assert qz.auto_quant(model, fused_kernels=True)[0] == "none"  # fp32: measured in half precision only
    assert qz.auto_quant(model.to(torch.bfloat16), fused_kernels=True)[0] == "int8"
    model.float()
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(100, 64, bias=False)  # 100 inputs: no groups of 32
    scheme, why = qz.auto_quant(model, fused_kernels=False)
    assert scheme == "int8" and "groups of 32" in why
    assert qz.auto_quant(model.to("meta"), fused_kernels=False)[0] == "none"
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert parser.parse_args([]).draft_quant == "auto"
    measuring = argparse.ArgumentParser()  # bench_engine, tune_kernels: the draft's own weights unless named
    add_model_args(measuring, auto_draft=False)
    assert measuring.parse_args([]).draft_quant == "none"
    with pytest.raises(SystemExit):
        measuring.parse_args(["--draft-quant", "auto"])
    pair = load_pair("tiny", device="cpu", draft_quant="auto")
    assert pair.draft_quant == "int4" and isinstance(pair.draft.model.lm_head, qz.QuantLinear)
    assert load_pair("tiny", device="cpu", draft_quant="none").draft_quant == "none"


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    return load_pair("tiny", device="cpu", draft_quant=request.param)


def test_greedy_with_a_quantized_draft_is_plain_greedy(quantized):
    plain_pair = load_pair("tiny", device="cpu")
    assert quantized.draft.weight_bytes() < plain_pair.draft.weight_bytes() / 2  # fp32 tiny: 4 bytes -> 1 or 1/2
    assert isinstance(quantized.draft.model.lm_head, qz.QuantLinear) and quantized.draft_quant in ("int8", "int4")
    for seed in range(3):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate(quantized.target, NoDrafter(quantized.device), prompt, 48, k=0)
        spec = generate(quantized.target, ModelDrafter(quantized.draft), prompt, 48, k=4)
        assert spec.tokens == plain.tokens and 0 < spec.accepted < spec.drafted  # both paths of the rule ran


def test_the_whole_loop_with_a_quantized_draft_samples_the_target(quantized):
    """The law of the first 3 tokens of 400 seeded generations against the target's exact sequence probabilities:
    the correct loop passes, the softmax-q bug fails with power >= 0.99 (as test_dist's whole-loop test)."""
    checks = dt.loop_checks(quantized, ["softmax-q"], 400, 0, Sampling(1.5))
    by = {c.variant: c for c in checks}
    assert by["correct"].verdict == "pass" and by["softmax-q"].verdict == "FAIL"
    assert by["softmax-q"].power >= dt.POWER_GOAL


@pytest.mark.real
def test_real_pair_with_an_int4_draft_is_plain_greedy():
    pair = load_pair("qwen-coder", device="cpu", draft_quant="int4")
    prompt = pair.tokenizer("def fibonacci(n):").input_ids
    plain = generate(pair.target, NoDrafter(pair.device), prompt, 24, k=0)
    spec = generate(pair.target, ModelDrafter(pair.draft), prompt, 24, k=4)
    assert spec.tokens == plain.tokens and spec.accepted > 0


# ---- the cache of packed weights -------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    """Every load in this module caches its packed weights in a folder of its own, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("cache")
        patch.setattr(qz, "cache_root", lambda: root)
        yield root


def quantize_tiny(scheme: str, which: str = "draft") -> tuple[torch.nn.Module, dict]:
    model = build_tiny(which, torch.device("cpu"), torch.float32)
    return model, qz.quantize_model(model, scheme)


def layers(model) -> dict[str, qz.QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, qz.QuantLinear)}


@pytest.fixture
def counted_packs(monkeypatch):
    """The number of pack() calls (one per layer quantized)."""
    calls = []
    pack = qz.pack
    monkeypatch.setattr(qz, "pack", lambda *a, **k: calls.append(a[1]) or pack(*a, **k))
    return calls


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_second_load_reads_the_cache_and_gives_the_same_layers(scheme, counted_packs, monkeypatch):
    first, done = quantize_tiny(scheme, "target")
    assert done["cache"].startswith("quantized") and len(counted_packs) == done["layers"] == 15
    monkeypatch.setattr(qz, "pack", lambda *a, **k: pytest.fail("the second load quantized again"))
    second, again = quantize_tiny(scheme, "target")
    assert again["cache"] == "cached"
    one, two = layers(first), layers(second)
    assert one.keys() == two.keys() and len(one) == 15
    x = torch.randn(3, 64)
    for name in one:
        assert one[name].codes.dtype == two[name].codes.dtype and torch.equal(one[name].codes, two[name].codes)
        assert torch.equal(one[name].scales, two[name].scales), name
        if one[name].in_features == 64:
            assert torch.equal(one[name](x), two[name](x))


@pytest.mark.parametrize("change", ["cache_format", "torch"])
def test_a_changed_key_rebuilds(change, counted_packs, monkeypatch):
    quantize_tiny("int8")
    counted_packs.clear()
    if change == "torch":  # another torch may lay the packed codes out otherwise
        monkeypatch.setattr(qz.torch, "__version__", "0.0.0-another")
    else:
        monkeypatch.setattr(qz, "CACHE_FORMAT", qz.CACHE_FORMAT + 1)
    _, done = quantize_tiny("int8")
    assert len(counted_packs) == 15 and f"stale entry ({change} changed)" in done["cache"]
    _, again = quantize_tiny("int8")
    assert again["cache"] == "cached" and len(counted_packs) == 15


def test_other_source_weights_are_another_entry(counted_packs):
    quantize_tiny("int8", "draft")
    quantize_tiny("int8", "target")
    counted_packs.clear()
    _, draft = quantize_tiny("int8", "draft")
    _, target = quantize_tiny("int8", "target")
    assert draft["cache"] == target["cache"] == "cached" and not counted_packs
    with torch.no_grad():
        model = build_tiny("draft", torch.device("cpu"), torch.float32)
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one weight of 16,640 changed
    assert "quantized" in qz.quantize_model(model, "int8")["cache"] and len(counted_packs) == 15


def test_a_named_source_keys_the_cache_without_reading_every_weight(monkeypatch):
    """With `weights_source` (the packaged loader's verified GGUF hash and dtype) the key hashes the source's name
    and each weight's two ends, not all of its bytes: another source, or a weight changed at either end, is another
    key; the same source is the same key as before."""
    model = build_tiny("draft", torch.device("cpu"), torch.float32)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    full = qz.weights_digest(linears)
    named = qz.weights_digest(linears, "gguf abc as float32")
    assert named != full and named == qz.weights_digest(linears, "gguf abc as float32")
    assert qz.weights_digest(linears, "gguf abd as float32") != named
    monkeypatch.setattr(qz, "SAMPLE_BYTES", 64)  # the tiny weights are smaller than the default sample
    sampled = qz.weights_digest(linears, "gguf abc as float32")
    with torch.no_grad():
        head = model.lm_head.weight  # 8,192 values: 64 bytes = its first and last 16
        head[0, 1] += 1.0
        assert qz.weights_digest(linears, "gguf abc as float32") != sampled
        head[0, 1] -= 1.0
        head[-1, -1] += 1.0
        assert qz.weights_digest(linears, "gguf abc as float32") != sampled
        head[-1, -1] -= 1.0
        head[100, 7] += 1.0  # the middle: not sampled, the same key (the source's name vouches for it)
        assert qz.weights_digest(linears, "gguf abc as float32") == sampled


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "manifest"])
def test_a_corrupt_entry_is_rebuilt_not_used(damage, counted_packs):
    fresh, _ = quantize_tiny("int4", "draft")
    key = qz.cache_key(qz.weights_digest([(n, m) for n, m in build_tiny("draft", "cpu", torch.float32)
                                          .named_modules() if isinstance(m, torch.nn.Linear)]), "int4")
    folder = qz.cache_folder(key)
    data = folder / "weights.safetensors"
    raw = bytearray(data.read_bytes())
    if damage == "flipped byte":
        raw[-100] ^= 0x10  # inside the last tensor's bytes: the file still parses
        data.write_bytes(bytes(raw))
    elif damage == "truncated":
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        (folder / "manifest.json").write_text("{")
    counted_packs.clear()
    rebuilt, done = quantize_tiny("int4", "draft")
    assert len(counted_packs) == 15 and ("corrupt" in done["cache"] or "unreadable" in done["cache"])
    for name, layer in layers(fresh).items():
        assert torch.equal(layer.codes, layers(rebuilt)[name].codes) and torch.equal(layer.scales,
                                                                                     layers(rebuilt)[name].scales)
    _, again = quantize_tiny("int4", "draft")
    assert again["cache"] == "cached"


# ---- a quantized target: another model, measured against the one it came from -------------------------------------


def test_kl_is_of_the_reference_against_the_quantized_on_hand_built_rows():
    """p = [0.9, 0.1] (reference), q = [0.5, 0.5]: KL(p || q) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.3681, while the
    reverse KL(q || p) = 0.5 ln(0.5 / 0.9) + 0.5 ln 5 = 0.5108; a second row whose argmaxes differ."""
    p = torch.tensor([[0.9, 0.1], [0.4, 0.6]]).log()
    q = torch.tensor([[0.5, 0.5], [0.7, 0.3]]).log()
    agree, kl = qr.divergence(p, q)
    assert agree.tolist() == [True, False]
    expected = [0.9 * math.log(1.8) + 0.1 * math.log(0.2), 0.4 * math.log(4 / 7) + 0.6 * math.log(2)]
    assert kl.tolist() == pytest.approx(expected, rel=1e-6)  # fp32 logs and products: a few eps32 relative
    zero_p = torch.tensor([[0.0, 1.0]]).log()  # log 0 = -inf: that word adds nothing (p log p -> 0), not NaN
    assert qr.divergence(zero_p, q[:1])[1].item() == pytest.approx(math.log(2), rel=1e-6)


PROMPTS = ["def add(a, b):", "Write a haiku about rain.", "SELECT name FROM"]


@pytest.fixture(scope="module")
def report_pair():
    return load_pair("tiny", device="cpu", target_quant="int4", report_prompts=PROMPTS, report_tokens=16)


def test_the_target_report_is_measured_on_the_reference_text(report_pair):
    """The pair serves the int4 target, and its report is agreement in [0, 1] and KL > 0 pooled over every
    position; recomputed here independently (transformers' forward of prompt + text without a cache, the rows
    that predict the text, torch's kl_div), row for row."""
    pair, report = report_pair, report_pair.target_report
    assert pair.target_quant == "int4" and isinstance(pair.target.model.lm_head, qz.QuantLinear)
    assert pair.setup_fields()["target_quant_report"] is report and report["format"] == "int4"
    assert 0 <= report["agreement"] <= 1 and report["kl_mean"] > 0 and report["prompts"] == 3
    reference = build_tiny("target", torch.device("cpu"), torch.float32)

    def kl(p, q):  # KL(p || q) per row, torch's own: kl_div(input = log q, target = log p)
        return torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)

    variants, agree = {"right": [], "reversed": [], "a row later": [], "a row earlier": []}, []
    for prompt in PROMPTS:
        ids = chat_ids(pair.tokenizer, prompt)
        text = qr.greedy_text(EagerModel(reference, pair.target.vocab), ids, 16, pair.eos)
        full = torch.tensor([ids + text])
        with torch.inference_mode():
            p = torch.log_softmax(reference(full).logits[0, :, : pair.target.vocab].float(), -1)
            q = torch.log_softmax(pair.target.model(full).logits[0, :, : pair.target.vocab].float(), -1)
        rows = slice(len(ids) - 1, len(ids) - 1 + len(text))  # row i predicts token i + 1
        assert p[rows].argmax(-1).tolist() == text  # these rows are the ones the greedy text came from
        variants["right"].append(kl(p[rows], q[rows]))
        variants["reversed"].append(kl(q[rows], p[rows]))
        variants["a row later"].append(kl(p, q)[len(ids): len(ids) + len(text)])
        variants["a row earlier"].append(kl(p, q)[len(ids) - 2: len(ids) - 2 + len(text)])
        agree.append(p[rows].argmax(-1) == q[rows].argmax(-1))
    assert report["positions"] == sum(len(a) for a in agree)
    assert report["agreement"] == torch.cat(agree).float().mean().item()
    # The same fp32 quantity through differently shaped products: the tiny target's logits are below 30 in size
    # and a product sums at most 128 terms, so a logit moves by at most 128 eps32 * 30 = 4.6e-4, a log-softmax
    # value by twice that, and a KL (a p-weighted mean of differences of two of them) by 4 * 4.6e-4 < 2e-3.
    tolerance = 4 * 128 * torch.finfo(torch.float32).eps * 30
    got = torch.tensor([kl for row in report["per_prompt"] for kl in row["kl"]])
    right = torch.cat(variants["right"])
    assert (got - right).abs().max() <= tolerance
    assert report["kl_mean"] == pytest.approx(right.mean().item(), abs=tolerance)
    for wrong in ("reversed", "a row later", "a row earlier"):  # each mistake is far outside that tolerance
        assert (got - torch.cat(variants[wrong])).abs().max() > 10 * tolerance, wrong


def test_the_unquantized_target_against_itself_is_kl_0_and_agreement_1(tiny):
    prompts = [chat_ids(tiny.tokenizer, p) for p in PROMPTS]
    reference = qr.reference_run(tiny.target, prompts, 16, tiny.eos)
    report = qr.compare(tiny.target, reference, "none")
    assert report["agreement"] == 1 and report["kl_mean"] == 0 and report["kl_max"] == 0
    assert report["positions"] == sum(len(t) for t in reference.texts) > 3


def test_the_target_path_refuses_with_the_reason():
    """The same refusals as the draft's, naming --target-quant: fp8, an unknown format, CUDA, unpackable shapes."""
    with pytest.raises(ModelError, match="--target-quant: fp8"):
        load_pair("tiny", device="cpu", target_quant="fp8")
    with pytest.raises(ModelError, match="unknown quantization 'int3'"):
        load_pair("tiny", device="cpu", with_draft=False, target_quant="int3")
    reason = qz.quant_error("--target-quant", "int4", "mps")
    assert "--target-quant: int4" in reason and "use --target-quant none" in reason

    class TwoLayers(torch.nn.Module):
        device, dtype = torch.device("cpu"), torch.float32

        def __init__(self):
            super().__init__()
            self.fits, self.odd = torch.nn.Linear(64, 64), torch.nn.Linear(100, 64)

    model = TwoLayers()
    with pytest.raises(ModelError, match=r"--target-quant: layer odd: int4: a layer with 100 inputs .* groups of 32"):
        qz.quantize_model(model, "int4", "--target-quant")
    assert type(model.fits) is torch.nn.Linear  # refused before any layer was replaced
    assert qz.quantize_model(model, "int8", "--target-quant")["layers"] == 2  # int8 takes any shape
    parser = argparse.ArgumentParser()
    add_model_args(parser, draft=False)
    assert parser.parse_args([]).target_quant == "none"  # off unless asked for
    assert parser.parse_args(["--target-quant", "int8"]).target_quant == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target-quant", "int3"])


def test_greedy_speculation_is_exact_against_the_quantized_target(report_pair):
    """Exactness is against the target that is served: speculation reproduces the int4 target's plain greedy
    text, which is not the unquantized target's everywhere (the report's agreement is below 1)."""
    pair = report_pair
    assert report_pair.target_report["agreement"] < 1
    for seed in range(2):
        prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = generate(pair.target, NoDrafter(pair.device), prompt, 32, k=0)
        spec = generate(pair.target, ModelDrafter(pair.draft), prompt, 32, k=4)
        assert spec.tokens == plain.tokens and 0 < spec.accepted < spec.drafted


def test_spec_greedy_names_the_target_format_and_reports_it(monkeypatch, tmp_path, capsys):
    from spec import io, spec_greedy

    monkeypatch.setattr(io, "RESULTS_DIR", tmp_path)
    out = spec_greedy.main(["--pair", "tiny", "--device", "cpu", "--limit", "2", "--max-new-tokens", "8",
                            "--target-quant", "int8", "--quiet"])
    printed = capsys.readouterr().out
    assert out["target_quant"] == "int8" and out["draft_quant"] == "int4"  # --draft-quant auto, on a CPU
    assert out["backend"] == "graph"  # --backend auto: a Llama on a CPU gets the static cache
    report = out["target_quant_report"]
    assert report["prompts"] == 2 and report["positions"] <= 16 and 0 <= report["agreement"] <= 1  # its own set
    assert "int8 TARGET" in printed and "plain greedy decoding of the int8 target" in printed
    assert "mean KL(p_float32 || p_int8)" in printed
    (saved,) = tmp_path.glob("spec_greedy-*Z.json")
    assert json.loads(saved.read_text())["target_quant_report"]["kl_mean"] == report["kl_mean"]


def test_the_server_and_bench_label_a_quantized_target(monkeypatch, tmp_path):
    """The server reports the target's format and its distance from the unquantized one (measured at load on
    the short set), and bench.py's rows carry the format in their precision."""
    from bench import precision
    from tests.test_server import ServerProcess

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    server = ServerProcess("--target-quant", "int8", "--draft-quant", "int4", key=None)
    try:
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        logs = server.logs()
    finally:
        server.stop()
    served = card["speculation"]
    assert served["target_quant"] == "int8" and served["draft_quant"] == "int4"
    report = served["target_quant_report"]
    assert report["format"] == "int8" and report["prompts"] == 3 and 0 < report["positions"] <= 3 * 32
    assert "THIS CHANGES THE MODEL" in logs and "int8 TARGET weights" in logs
    assert precision(served) == "float32, int8 target, int4 draft"
    assert precision({"dtype": "bfloat16", "target_quant": "none"}) == "bfloat16"


# ---- the graph backend's layout and CUDA ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_layout_holds_the_same_codes(scheme, dtype):
    """PackedWeight (what the fused kernels read) stands for exactly the weights the CPU layers' codes stand for:
    the same codes and scales in another layout, two int4 codes a byte (a group's first half in the low nibbles,
    its second half in the high ones), at a
    quarter (int4: plus a scale and an offset per 32 inputs) or half of the bytes."""
    w = weights(48, 256, dtype, seed=3)
    packed = qz.pack_for_kernels(w, scheme)
    if scheme == "int8":
        reference = qz.dequantize_rows(*qz.quantize_int8(w))
        assert packed.nbytes() == 48 * 256 + 48 * w.element_size()
    else:
        codes, scales_and_zeros = qz.quantize_int4(w)
        reference = qz.dequantize_int4(codes, scales_and_zeros)
        assert torch.equal(packed.codes[:, 0] & 15, codes[:, 0].to(torch.uint8))  # input 0: byte 0's low nibble
        assert torch.equal(packed.codes[:, 0] >> 4, codes[:, 16].to(torch.uint8))  # input 16: its high nibble
        assert torch.equal(packed.codes[:, 17] >> 4, codes[:, 49].to(torch.uint8))  # group 1, input 32 + 16 + 1
        assert packed.nbytes() == 48 * 128 + 2 * 48 * 8 * w.element_size()
    assert torch.equal(packed.dequantize(), reference)
    assert packed.shape == (48, 256)
    with pytest.raises(ModelError, match="groups of 32"):
        qz.pack_for_kernels(torch.zeros(4, 100), "int4")


def test_graph_backend_on_a_cpu_runs_the_eager_backends_packed_layers():
    """Without the fused kernels (a CPU here) the graph backend takes int8 / int4 weights as the eager backend's
    packed layers, and refuses unknown formats and fp8 with the reason; `auto` picks it on a CPU too."""
    from spec.models import GraphModel, make_model

    model = build_tiny("draft", "cpu", torch.float32)
    with pytest.raises(ModelError, match="unknown quantization"):
        GraphModel(model, graphs=False, quant="int3")
    with pytest.raises(ModelError, match="fp8"):
        GraphModel(model, graphs=False, quant="fp8")
    static = GraphModel(model, graphs=False, quant="int8")
    assert static.quantized["scheme"] == "int8" and isinstance(model.lm_head, qz.QuantLinear)
    wrapped = make_model(build_tiny("draft", "cpu", torch.float32), None, "auto", "draft", quant="int8")
    assert isinstance(wrapped, GraphModel) and wrapped.quantized["scheme"] == "int8"
    assert make_model(build_tiny("draft", "cpu", torch.float32), None, "eager", "draft").quantized is None


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_joined_packed_layers_compute_what_each_one_does(scheme):
    """`fuse_packed`: one layer for several on the same input gives each one's outputs side by side, bit for bit
    (the same codes and scales per output row, each output summed by the same kernel), and the layers, whose codes
    became slices of the joined ones, still compute what they did. int4 rows join only where PyTorch's CPU layout
    allows it (checked on the installed torch), and layers of other formats or inputs do not join."""
    gen = torch.Generator().manual_seed(3)
    linears = [torch.nn.Linear(96, rows, bias=True) for rows in (128, 64, 80)]
    for linear in linears:
        torch.nn.init.normal_(linear.weight, generator=gen)
    layers = [qz.QuantLinear(linear, scheme) for linear in linears]
    x = torch.randn(3, 96, generator=gen)
    alone = [layer(x) for layer in layers]
    joined = qz.fuse_packed(layers)
    assert joined.out_features == 272 and joined.bias.shape == (272,)
    assert torch.equal(joined(x), torch.cat(alone, -1))
    assert all(torch.equal(layer(x), out) for layer, out in zip(layers, alone))
    assert layers[1].codes.untyped_storage().data_ptr() == joined.codes.untyped_storage().data_ptr()
    assert qz.packed_bytes(torch.nn.ModuleList(layers)) == sum(t.nbytes for t in joined.buffers()) + 272 * 4
    odd = [qz.QuantLinear(torch.nn.Linear(96, 80), scheme), qz.QuantLinear(torch.nn.Linear(96, 64), scheme)]
    assert (qz.fuse_packed(odd) is None) == (scheme == "int4")  # 80 rows end mid-block of the int4 layout
    assert qz.fuse_packed([qz.QuantLinear(torch.nn.Linear(96, 64), scheme),
                           qz.QuantLinear(torch.nn.Linear(96, 64), "int8" if scheme == "int4" else "int4")]) is None
    assert qz.fuse_packed([qz.QuantLinear(torch.nn.Linear(96, 64), scheme),
                           qz.QuantLinear(torch.nn.Linear(64, 64), scheme)]) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


FP8_GPU = pytest.mark.skipif(not (torch.cuda.is_available() and qz.fp8_device(torch.device("cuda"))),
                             reason="needs a GPU that reads fp8 (compute capability 8.9+)")


@cuda
@pytest.mark.parametrize("scheme, dtype", [("int8", torch.float32), ("int8", torch.bfloat16), ("int4", torch.bfloat16),
                                           pytest.param("fp8", torch.bfloat16, marks=FP8_GPU)])
def test_cuda_eager_layers_match_their_weights(scheme, dtype):
    """On CUDA the eager layers (int8 and fp8: cast and scale; int4: PyTorch's tinygemm) compute x . w^T for the
    weights their codes stand for, at 1 and 9 tokens."""
    linear = torch.nn.Linear(256, 96).to("cuda", dtype)
    with torch.no_grad():
        linear.weight.copy_(weights(96, 256, dtype, seed=5))
    layer = qz.QuantLinear(linear, scheme)
    w = qz.pack_for_kernels(linear.weight.detach(), scheme).dequantize()  # the same codes, in fp32
    for tokens in (1, 9):
        x = torch.randn(tokens, 256, device="cuda").to(dtype)
        got = layer(x).float()
        ref = x.float() @ w.t() + linear.bias.float()
        # bf16: the de-quantised weight and the output each rounded once (2^-8 each); fp32: summation order only,
        # the kernel's and the reference's, each within K u = 256 x 2^-24 of sum |x w|
        scale = 2 ** -7 if dtype == torch.bfloat16 else 2 * 256 * 2 ** -24
        assert ((got - ref).abs() <= scale * (x.float().abs() @ w.abs().t() + linear.bias.float().abs())
                + 1e-6).all(), (scheme, tokens)


@cuda
@pytest.mark.parametrize("scheme", ["int8", "int4", "w4a8", pytest.param("fp8", marks=FP8_GPU)])
def test_cuda_graph_draft_quant_keeps_greedy_output(scheme):
    """A quantized draft on the graph backend (its fused kernels, fp32 here) changes no answer: greedy
    speculation equals plain greedy decoding of the unquantized fp32 target token for token, and the quantized
    draft still agrees with it often (w4a8: its one-token steps over 8-bit inputs, its other forwards int4's)."""
    from spec.models import make_model

    pair = load_pair("tiny", device="cuda", backend="graph", draft_quant=scheme)
    assert pair.draft.quant == scheme and pair.draft.fused_step and pair.target.quant == "none"
    unquantized = make_model(build_tiny("draft", "cuda", torch.float32), None, "graph", "d")
    assert pair.draft.weight_bytes() < unquantized.weight_bytes()
    prompt = list(range(40, 60))
    plain = generate(pair.target, NoDrafter("cuda"), prompt, 60, k=0).tokens
    for k in (1, 4):
        result = generate(pair.target, ModelDrafter(pair.draft), prompt, 60, k=k)
        assert result.tokens == plain
        assert 0 < result.alpha


# ---- the graph backend runs small forwards of packed weights as one-token steps where that measured cheaper ----


def test_stepwise_limit_takes_the_counts_where_steps_are_cheaper():
    from spec.models.graph import stepwise_limit

    # the H200's 1B draft (benchmarks/h200/bench_engine-session13-trees-quant.json), ms by token count
    assert stepwise_limit({1: 0.878, 2: 5.349, 5: 5.473, 8: 5.462, 16: 5.680}) == 5  # int4: 8 steps cost 7.0 > 5.5
    assert stepwise_limit({1: 0.732, 2: 2.673, 5: 2.444, 8: 2.418, 16: 2.587}) == 2  # int8
    assert stepwise_limit({1: 0.798, 2: 1.074, 5: 1.111, 8: 1.127, 16: 1.120}) == 0  # bf16: never
    assert stepwise_limit({1: 1.0, 2: 3.0, 3: 2.9, 4: 5.0}) == 2  # stops at the first count where steps lose
    assert stepwise_limit({1: 1.0}) == 0


def test_a_stepwise_forward_writes_what_one_forward_of_the_same_tokens_does(tiny):
    """With `stepwise`, a forward of up to that many tokens replays the one-token graph once a token: the same
    logits (fp32, up to the products' shapes) and the same cache as one forward over them; trees and longer
    forwards keep their own graphs."""
    from test_graph_trees import FP32_SHAPES, as_fused

    model, replays = as_fused(tiny)
    reference, _ = as_fused(tiny)
    text, new = list(b"def add(a, b):"), list(b" ret")
    for m in (model, reference):
        m.forward(text, keep=1)
    model.stepwise = 3
    replays.clear()
    assert (model.forward(new[:3], keep=2) - reference.forward(new[:3], keep=2)).abs().max() < FP32_SHAPES
    assert replays == [(1, False)] * 3 and model.length == reference.length == len(text) + 3
    assert (model.forward(new[3:]) - reference.forward(new[3:])).abs().max() < FP32_SHAPES  # the caches agree
    replays.clear()
    model.forward(list(b"turn a"))  # 6 tokens: past stepwise, one graph
    assert replays == [(6, False)]


def test_prepare_measures_where_packed_weights_go_stepwise(tiny, monkeypatch):
    """`prepare` times the one-token and the n-token graphs of a model with packed weights and sets `stepwise`
    from them; a model in its own dtype is not timed (its products never lose to steps)."""
    import contextlib

    from test_graph_trees import as_fused

    from spec.models import kernels

    monkeypatch.setattr(kernels, "compiling_ahead", lambda: contextlib.nullcontext(False))
    measured = {1: 0.9, 2: 5.3, 3: 5.4, 4: 5.5, 5: 5.5}
    for quant, want in (("none", 0), ("int4", 5)):
        model, _ = as_fused(tiny)
        model.quant = quant
        timed = []
        monkeypatch.setattr(model, "_replay_ms", lambda n, span, timed=timed: timed.append(n) or measured[n])
        model.prepare(5, 100)
        assert model.stepwise == want and timed == ([] if quant == "none" else [1, 2, 3, 4, 5])


def test_draft_quant_agreement_is_teacher_forced_on_the_text():
    """benchmarks/cpu/draft_quant.py's `agreement`: the target reading its own greedy text agrees everywhere (an
    off-by-one in the rows it compares would not); the tiny draft, nearly everywhere but not quite."""
    import importlib.util
    from pathlib import Path

    from spec.drafters import NoDrafter
    from spec.loop import generate
    from spec.models import load_pair as load

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu" / "draft_quant.py"
    spec_ = importlib.util.spec_from_file_location("draft_quant_script", path)
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)
    pair = load("tiny", device="cpu")
    prompt = list(b"def add(a, b):")
    text = generate(pair.target, NoDrafter(), prompt, 24, k=0).tokens
    assert script.agreements(pair.target, prompt, text) == [True] * 24
    draft = script.agreements(pair.draft, prompt, text)
    assert len(draft) == 24 and 0 < sum(draft) < 24


@pytest.mark.parametrize("backend", ["graph", "eager"])
def test_the_w4a8_emulation_rounds_every_product_a_draft_calls(backend):
    """benchmarks/cpu/draft_quant.py's `int4+a8`: every packed layer a forward of the draft calls gets its input
    rounded to 8 bits, the graph backend's joined gate/up (its own layers, not the transformers model's) included;
    a layer left out would measure another rounding than w4a8's. And the rounding is w4a8's."""
    import importlib.util
    from pathlib import Path

    from spec.models import load_pair as load

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu" / "draft_quant.py"
    spec_ = importlib.util.spec_from_file_location("draft_quant_script", path)
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)
    pair = load("tiny", device="cpu", backend=backend, draft_quant="int4")
    assert script.round_inputs_to_8_bits(pair.draft) > 0
    seen = {}  # layer -> the input it computed on (after the hooks)

    def record(module, args, out):  # (returns None: the output stays as it is)
        if isinstance(module, qz.QuantLinear):
            seen.setdefault(module, args[0].detach().clone())

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        pair.draft.forward(list(range(5, 12)))
    finally:
        handle.remove()
    assert seen
    for layer, x in seen.items():
        # on w4a8's grid already: rounding again moves an input by a few ulps of its group's largest (the step
        # recomputed from the rounded largest), where an input off the grid moves by up to half a step, top / 254
        xq, step = qz.inputs_in_8_bits(x)
        moved = ((xq * step).reshape(x.shape) - x.float()).abs().reshape(step.shape[:-1] + (-1,))
        assert (moved <= 4 * torch.finfo(x.dtype).eps * 127 * step).all(), layer


def test_the_llama_cpp_ratio_compares_decoding_alone():
    """benchmarks/cpu/target_quant.py: llama-bench's text generation times token steps only, so our side of the ratio
    leaves the prompt's forward out (tokens over the rounds' time), while `speedup` stays end to end."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu" / "target_quant.py"
    spec_ = importlib.util.spec_from_file_location("target_quant_script", path)
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)
    # two prompts: 64 tokens each; plain 2 s each with 0.4 s of prompt, speculative 1.5 s with 0.5 s of prompt
    rows = [{"id": f"p{i}", "identical": True, "tokens": 64, "plain_tokens": 64, "plain_s": 2.0, "spec_s": 1.5,
             "plain": {"tokens": 64, "decode_s": 1.6}, "spec": {"tokens": 64, "decode_s": 1.0, "drafted": 40,
                                                                "accepted": 30, "rounds": 20}} for i in range(2)]
    per = [{"positions": 64, "agreement": 1.0, "kl_mean": 0.0}]
    line = script.summarise("int4/int4", "short x2", 1, rows, per, llama_target=80.0)
    assert line["speedup"] == pytest.approx((64 / 1.5) / (64 / 2.0))  # end to end
    assert line["plain_decode_tok_s"] == pytest.approx(40.0) and line["spec_decode_tok_s"] == pytest.approx(64.0)
    assert line["plain_vs_llama_cpp"] == pytest.approx(0.5) and line["spec_vs_llama_cpp"] == pytest.approx(0.8)


@pytest.mark.parametrize("tied", [False, True])
def test_the_bytes_a_step_reads_leave_the_embedding_table_out_unless_it_is_the_head(private_cache, tied):
    """The load's log line says what a step reads: the embedding table is looked up one row a step (left out),
    unless it is also the head (tied, unquantized). Once the head is packed, a tied table is looked up too."""
    from spec.models.base import embedding_bytes, parameter_bytes, read_bytes
    from spec.models.pairs import describe_quantized, make_model

    model = build_tiny("target", torch.device("cpu"), torch.float32)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
    table = model.model.embed_tokens.weight
    assert embedding_bytes(model) == {"bytes": table.nbytes, "tied": tied}
    whole = parameter_bytes(model)
    before = read_bytes(whole, embedding_bytes(model), packed_head=False)
    assert before == (whole if tied else whole - table.nbytes)
    wrapped = make_model(model, None, "eager", "target", quant="int8")
    assert not embedding_bytes(wrapped.model)["tied"]  # the head is packed layers now
    after = read_bytes(wrapped.weight_bytes(), embedding_bytes(wrapped.model), packed_head=True)
    assert after == wrapped.weight_bytes() - table.nbytes
    head = wrapped.model.lm_head
    assert after < before and head.codes.nbytes <= after  # the packed head is read whole, the table left out
    assert f"{before / 1e9:.2f} -> {after / 1e9:.2f} GB read a step" in describe_quantized("target", wrapped, before)
