"""Loading, verification, tokenizer compatibility, the cached forward and its rollback."""

import hashlib
import json
import sys

import pytest
import torch

import spec.models.pairs as pairs
from spec.models import (
    EagerModel,
    ModelError,
    TokenizerMismatch,
    byte_tokenizer,
    load_model,
    load_pair,
    pick_device,
    resolve_pair,
    rollback_cache,
    shared_vocab,
)
from spec.models.hub import load_tokenizer, vocabulary_fingerprint
from spec.models.packaged import PackagedGGUF, assemble_gguf

# ---- rollback -------------------------------------------------------------------------------------------------


def rollback_matches_fresh(model: EagerModel, a: list[int], b: list[int], c: list[int]) -> None:
    """Text a, then b, rolled back to a, then c  ==  text a then c on a fresh cache, bit for bit."""
    model.reset()
    model.forward(a)
    expected = model.forward(c)
    model.reset()
    model.forward(a)
    model.forward(b)
    model.rollback(len(a))
    assert model.length == len(a) == model.cache.get_seq_length()
    assert torch.equal(model.forward(c), expected)
    model.reset()


def test_rollback_equals_fresh_cache_tiny(tiny):
    rollback_matches_fresh(tiny.target, list(range(20, 60)), [1, 2, 3, 4, 5], [9, 8, 7])
    rollback_matches_fresh(tiny.draft, [5] * 7, [6], [7, 7])


def test_rollback_helper_rejects_growing_or_negative(tiny):
    model = tiny.target
    model.reset()
    model.forward([1, 2, 3])
    with pytest.raises(ValueError):
        rollback_cache(model.cache, 4)
    with pytest.raises(ValueError):
        rollback_cache(model.cache, -1)
    model.reset()


def test_forward_keeps_the_last_rows_and_cuts_the_vocabulary(tiny):
    model = EagerModel(tiny.target.model, vocab=200)
    full = model.forward([1, 2, 3, 4])
    assert full.shape == (4, 200) and full.dtype == torch.float32
    model.rollback(2)
    # float32, other chunking (T = 4): |dz| <= 2 eps32 S sum sqrt(n_i) = 2 x 6e-8 x 50 x 135 = 8e-4 (as in test_dist)
    assert torch.allclose(model.forward([3, 4], keep=1), full[-1:], rtol=0, atol=1e-3)  # other chunking, same math


def test_weights_off_a_cache_line_get_memory_of_their_own_and_keep_their_values_and_ties():
    """A checkpoint mapped from its file leaves weights where the file put them; EagerModel copies those that do not
    start on a 64-byte line (CPU products read them faster, spec.models.eager.align_weights), and nothing else."""
    from spec.models.eager import ALIGNMENT, align_weights

    model = load_pair("tiny", device="cpu", with_draft=False).target.model
    model.get_output_embeddings().weight = head = model.get_input_embeddings().weight  # tied, as the Qwen 0.5B's
    off = model.model.layers[0].mlp.up_proj.weight
    for tensor in (off, head):  # 16 bytes past a cache line, as a weight at a file offset of 16 mod 64
        storage = torch.empty(tensor.numel() + 4, dtype=tensor.dtype)
        tensor.data = storage[4:].view_as(tensor).copy_(tensor.data)
    kept = model.model.layers[0].mlp.down_proj.weight.data_ptr()  # already on a line
    values = {name: t.detach().clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3]])
    logits = model(ids).logits
    assert off.data_ptr() % ALIGNMENT and head.data_ptr() % ALIGNMENT

    EagerModel(model)

    assert all(t.data_ptr() % ALIGNMENT == 0 for t in [*model.parameters(), *model.buffers()] if t.numel())
    assert model.model.layers[0].mlp.down_proj.weight.data_ptr() == kept
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight is head
    assert all(torch.equal(t, values[name]) for name, t in model.state_dict().items())
    assert torch.equal(model(ids).logits, logits)
    assert align_weights(model) == 0  # nothing left to move


# ---- presets, device, errors ----------------------------------------------------------------------------------


def test_tiny_pair_loads_with_a_shared_vocabulary(tiny):
    assert tiny.name == "tiny" and tiny.draft is not None
    assert tiny.target.vocab == tiny.draft.vocab == len(tiny.tokenizer)
    assert tiny.eos == {tiny.tokenizer.eos_token_id}


def test_auto_prefers_cached_llama(monkeypatch):
    monkeypatch.setattr(pairs, "hub_cached", lambda repo: True)
    assert resolve_pair("auto")[0] == "llama"
    monkeypatch.setattr(pairs, "hub_cached", lambda repo: False)
    name, why = resolve_pair("auto")
    assert name == "qwen-coder" and "no local Llama" in why


def test_unknown_pair_and_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown pair"):
        resolve_pair("gpt-9")
    with pytest.raises(ModelError, match="no GGUF file"):
        load_model(str(tmp_path / "missing.gguf"), torch.device("cpu"), torch.float32)
    with pytest.raises(ModelError, match="cannot load"):
        load_model("./not/a/folder", torch.device("cpu"), torch.float32)
    with pytest.raises(ModelError, match="unknown packaged"):
        load_model("packaged:qwen-99b", torch.device("cpu"), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ModelError, match="no CUDA"):
        pick_device("cuda")
    with pytest.raises(ModelError, match="no CUDA"):
        load_pair("tiny", device="cuda")


def test_truncated_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)
    with pytest.raises(ModelError, match="broken.gguf"):
        load_model(str(bad), torch.device("cpu"), torch.float32)


# ---- tokenizers -----------------------------------------------------------------------------------------------


def test_padded_embeddings_share_the_tokenizer_length():
    tok = byte_tokenizer()
    # Same vocabulary, embedding matrices padded to different sizes (like Qwen2.5 7B vs 0.5B).
    assert shared_vocab(tok, tok, target_rows=320, draft_rows=272) == len(tok) == 259


def test_a_draft_with_byte_identical_vocabulary_files_reuses_the_targets_tokenizer(tmp_path):
    """Only a load for the vocabulary reuses a tokenizer, only one read from the same vocabulary files, whatever
    the chat templates; any other load reads its own files."""
    for name in ("a", "b", "c"):
        byte_tokenizer().save_pretrained(tmp_path / name)
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages }}")  # a draft's own template: no matter
    config = tmp_path / "c" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    a = load_tokenizer(str(tmp_path / "a"))
    assert load_tokenizer(str(tmp_path / "b"), vocabulary_only=True) is a
    assert load_tokenizer(str(tmp_path / "b")) is not a  # a full load (its template matters) reads its files
    c = load_tokenizer(str(tmp_path / "c"), vocabulary_only=True)
    assert c is not a and c.model_max_length == 77 != a.model_max_length
    assert vocabulary_fingerprint(str(tmp_path)) is None  # no tokenizer there: never shared


def test_one_shared_tokenizer_needs_no_vocabulary_comparison():
    class Opaque:  # a tokenizer whose vocabulary must not be read
        def __len__(self):
            return 300

        def get_vocab(self):
            raise AssertionError("compared a tokenizer with itself")

    tok = Opaque()
    assert shared_vocab(tok, tok, target_rows=320, draft_rows=310) == 300


def test_different_vocabularies_are_refused_unless_allowed():
    tok = byte_tokenizer()
    other = byte_tokenizer()
    other.add_tokens(["<|other|>"])
    with pytest.raises(TokenizerMismatch, match="allow-other-family"):
        shared_vocab(tok, other, 259, 260)
    assert shared_vocab(tok, other, 259, 260, allow_other_family=True) == 259


# ---- the packaged GGUF: assembly and verification --------------------------------------------------------------


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three installed 'part packages' holding slices of a small file, and its PackagedGGUF spec."""
    slices = [b"GGUF-head-", b"middle-bytes-", b"tail"]
    for i, data in enumerate(slices, 1):
        pkg = tmp_path / "site" / f"fake_model_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(slices)
    spec = PackagedGGUF("fake", "fake.gguf", len(whole), hashlib.sha256(whole).hexdigest(), "fake-model-part", "1.0", 3)
    yield spec, whole
    for i in range(1, 4):
        sys.modules.pop(f"fake_model_part{i}", None)


def test_assembly_concatenates_in_part_order_and_verifies(fake_parts, tmp_path):
    spec, whole = fake_parts
    out = assemble_gguf(spec, tmp_path / "cache")
    assert out.read_bytes() == whole
    assert list((tmp_path / "cache").iterdir()) == [out]  # no temporary file left behind


def test_wrong_hash_leaves_no_file_and_names_the_packages(fake_parts, tmp_path):
    spec, _ = fake_parts
    bad = PackagedGGUF(spec.name, spec.file_name, spec.size, "0" * 64, spec.package, spec.version, spec.parts)
    with pytest.raises(ModelError, match="force-reinstall fake-model-part1==1.0"):
        assemble_gguf(bad, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_part_names_the_package(fake_parts, tmp_path):
    spec, _ = fake_parts
    more = PackagedGGUF(spec.name, spec.file_name, spec.size, spec.sha256, spec.package, spec.version, 4)
    with pytest.raises(ModelError, match="fake-model-part4"):
        assemble_gguf(more, tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_corrupted_cached_file_is_rebuilt(fake_parts, tmp_path):
    spec, whole = fake_parts
    out = assemble_gguf(spec, tmp_path / "cache")
    out.write_bytes(b"X" + whole[1:])  # same size, one byte flipped
    assert assemble_gguf(spec, tmp_path / "cache").read_bytes() == whole


# ---- the real embedded pair ------------------------------------------------------------------------------------


@pytest.mark.real
def test_real_pair_loads_with_identical_tokenizers(real):
    assert real.name == "qwen-coder" and real.dtype == torch.bfloat16
    assert real.target.model.config.model_type == "qwen2" and real.draft.model.config.model_type == "qwen2"
    assert real.target.vocab == real.draft.vocab and real.target.vocab >= 151_643
    assert real.draft_tokenizer is None
    assert 151645 in real.eos  # <|im_end|> ends a chat answer


@pytest.mark.real
def test_real_rollback_equals_fresh_cache(real):
    ids = real.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n").input_ids
    rollback_matches_fresh(real.target, ids, [13, 14, 15, 16], ids[:3])
    rollback_matches_fresh(real.draft, ids, [13], ids[:2])


def test_models_named_on_the_command_line_are_what_the_log_names(tmp_path):
    """--target/--draft replace the preset: the pair is called custom and `why` says so (not "auto: ...")."""
    both = load_pair("auto", target="tiny:target", draft="tiny:draft", dtype="float32")
    assert both.name == "custom" and both.why == "--target and --draft given"
    one = load_pair("tiny", draft="tiny:target")
    assert one.name == "tiny" and one.why == "--draft given; the rest from pair tiny"
    alone = load_pair("auto", target="tiny:target", with_draft=False, dtype="float32")
    assert alone.name == "custom" and alone.why == "--target given"
