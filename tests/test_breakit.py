"""Break-It variants and the other-family draft (remapping), on the tiny pair and hand-built tokenizers."""

import copy
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from spec.deliberately_wrong import SoftmaxQDrafter, StaleCacheModel, resample_from_p
from spec.drafters import ModelDrafter, NoDrafter
from spec.loop import generate
from spec.models import EagerModel, byte_tokenizer, load_pair
from spec.remap import RemappedDrafter, token_keys, token_map
from spec.warps import Decoding, Sampling, warp

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def tiny():
    # One intra-op thread: the tiny layers gain nothing from more, and a busy CPU makes extra threads very slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_pair("tiny", device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt(tiny):
    return tiny.tokenizer(PROMPT).input_ids


# ---- no-rollback ---------------------------------------------------------------------------------------------


def test_no_rollback_breaks_greedy_identity_in_the_round_after_a_rejection(tiny, prompt):
    plain = generate(tiny.target, NoDrafter(), prompt, 24, k=0, timing=False).tokens
    good = generate(tiny.target, ModelDrafter(tiny.draft), prompt, 24, k=4, timing=False)
    assert good.tokens == plain  # the control: the real cache keeps identity
    broken = generate(StaleCacheModel.wrap(tiny.target), ModelDrafter(tiny.draft), prompt, 24, k=4, timing=False)
    first = broken.rounds[0]
    assert first.accepted < first.drafted  # round one rejects a draft, so it leaves stale entries behind ...
    assert first.tokens == plain[: len(first.tokens)]  # ... but what it emits is still right
    second = broken.rounds[1]
    done = len(first.tokens)
    assert second.tokens != plain[done : done + len(second.tokens)]  # round two reads the stale drafts


def test_stale_cache_still_starts_each_request_clean(tiny, prompt):
    stale = StaleCacheModel.wrap(tiny.target)
    stale.forward(prompt)
    stale.rollback(3)
    assert stale.length == 3
    stale.reset()
    assert stale.length == 0
    first = stale.forward(prompt)
    tiny.target.reset()
    # The same weights, shapes and ops on a fresh cache both times: bit-identical (as test_common's rollback check)
    assert torch.equal(first, tiny.target.forward(prompt))
    tiny.target.reset()
    with pytest.raises(ValueError):
        stale.rollback(stale.length + 1)


# ---- resample-p and softmax-q ---------------------------------------------------------------------------------


def test_resample_p_keeps_like_the_real_rule_but_redraws_from_p():
    # q puts everything on token 0, p half: the draft 0 is kept half the time; a rejection then redraws from p.
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]).expand(40_000, 2, 2)
    q = torch.tensor([[[1.0, 0.0]]]).expand(40_000, 1, 2)
    drafts = torch.zeros(40_000, 1, dtype=torch.long)
    n_accepted, nxt = resample_from_p(p, q, drafts, torch.Generator().manual_seed(0))
    # 5 standard errors (two-sided false failure 6e-7): 5 sqrt(0.25 / 40000) = 0.0125
    assert float(n_accepted.float().mean()) == pytest.approx(0.5, abs=0.0125)
    rejected = nxt[n_accepted == 0]
    # 5 s.e. of a mean of >= 19500 rejections (20000 - 5 sigma of the count): 5 sqrt(0.25 / 19500) = 0.018
    assert float((rejected == 0).float().mean()) == pytest.approx(0.5, abs=0.018)  # the real rule: never 0


def test_softmax_q_drafter_drafts_the_argmax_and_reports_the_softmax(tiny, prompt):
    sampling = Sampling(1.0)
    drafter = SoftmaxQDrafter(tiny.draft)
    tiny.draft.reset()
    drafts, q, *_ = drafter.propose(prompt, 3, Decoding(sampling), torch.Generator().manual_seed(0))
    tiny.draft.reset()
    logits = tiny.draft.forward([*prompt, *drafts[:2].tolist()])[-3:]
    tiny.draft.reset()
    assert drafts.tolist() == logits.argmax(-1).tolist()
    # float32 logits of two chunkings (T ~ 16): |dz| <= 2 eps32 S sum sqrt(n_i) = 2 x 6e-8 x 50 x 143 = 8.5e-4
    # (as in test_dist); softmax: |dq| <= 2 |dz| q, a relative bound
    assert torch.allclose(q, warp(logits, sampling), rtol=2e-3, atol=0)
    # Greedy decoding never reads q: there the drafter is the normal one.
    greedy = generate(tiny.target, SoftmaxQDrafter(tiny.draft), prompt, 16, k=3, timing=False)
    assert greedy.tokens == generate(tiny.target, NoDrafter(), prompt, 16, k=0, timing=False).tokens


# ---- other family: hand-built tokenizers ------------------------------------------------------------------------


def shuffled_byte_tokenizer(perm: list[int], extra: int = 0):
    """The byte tokenizer with every id i renamed perm[i] (another "family" with the same strings), plus `extra`
    added tokens the target has no twin for (a larger vocabulary)."""
    spec = json.loads(byte_tokenizer().backend_tokenizer.to_str())
    spec["model"]["vocab"] = {piece: perm[i] for piece, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        added["id"] = perm[added["id"]]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<|bos|>",
                                  eos_token="<|eos|>", pad_token="<|pad|>")
    if extra:
        tok.add_tokens([f"<merge{i}>" for i in range(extra)])
    return tok


def sentencepiece_style_tokenizer():
    """A SentencePiece-style vocabulary ("▁" = space, "<0xNN>" = raw byte), like Gemma's or Llama 2's."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<0x0A>": 3, "<0xC3>": 4, "▁": 5, "a": 6, "b": 7, "▁a": 8, "ab": 9}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def test_byte_level_keys_are_the_bytes():
    tok = byte_tokenizer()
    keys = token_keys(tok, len(tok))
    assert sorted(k for k in keys if isinstance(k, bytes)) == [bytes([b]) for b in range(256)]
    assert keys[tok.eos_token_id] == ("special", "<|eos|>")


def test_sentencepiece_keys_and_map_onto_a_byte_vocabulary():
    sp = sentencepiece_style_tokenizer()
    assert token_keys(sp, 10)[3:] == [b"\n", b"\xc3", b" ", b"a", b"b", b" a", b"ab"]
    target = byte_tokenizer()
    mapping = token_map(sp, target, 10, len(target)).tolist()
    byte_id = {k: i for i, k in enumerate(token_keys(target, len(target)))}
    assert mapping[3:8] == [byte_id[b"\n"], byte_id[b"\xc3"], byte_id[b" "], byte_id[b"a"], byte_id[b"b"]]
    assert mapping[8:] == [-1, -1]  # merges the byte vocabulary lacks
    assert mapping[:3] == [-1, -1, -1]  # another family's specials


def test_shuffled_family_maps_back_exactly_and_extra_ids_never_do():
    target = byte_tokenizer()
    perm = torch.randperm(len(target), generator=torch.Generator().manual_seed(3)).tolist()
    draft = shuffled_byte_tokenizer(perm, extra=41)
    mapping = token_map(draft, target, len(draft), len(target))
    assert len(draft) == 300 and mapping.shape == (300,)
    assert all(int(mapping[perm[i]]) == i for i in range(len(target)))
    assert (mapping[len(target):] == -1).all()


def permuted_draft(tiny, perm: list[int]) -> EagerModel:
    """The tiny draft with its vocabulary rows renamed by perm: the same model, speaking shuffled ids."""
    model = copy.deepcopy(tiny.draft.model)
    inverse = torch.empty(len(perm), dtype=torch.long)
    inverse[torch.tensor(perm)] = torch.arange(len(perm))
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight.copy_(weight[inverse])
    return EagerModel(model, tiny.draft.vocab, name="shuffled draft")


def test_remapped_same_model_drafts_what_the_model_itself_drafts(tiny, prompt):
    """A shuffled-id copy of the draft, translated back: the same drafts and the same q as the draft itself."""
    perm = torch.randperm(tiny.target.vocab, generator=torch.Generator().manual_seed(5)).tolist()
    drafter = RemappedDrafter(permuted_draft(tiny, perm), shuffled_byte_tokenizer(perm), tiny.tokenizer,
                              tiny.target.vocab)
    assert drafter.coverage == 1.0
    assert drafter.express(prompt) == [perm[i] for i in prompt]
    itself = ModelDrafter(tiny.draft)
    longer = prompt + tiny.tokenizer(" return a + b").input_ids  # not what was drafted: the cache must catch up
    for seq in (prompt, longer, prompt):
        mine, _, *_ = drafter.propose(seq, 4, Decoding(Sampling()), None)
        tiny.draft.reset()
        theirs, _, *_ = itself.propose(seq, 4, Decoding(Sampling()), None)
        assert mine.tolist() == theirs.tolist()
    sampling = Sampling(0.8, top_k=50)
    _, q_mine, *_ = drafter.propose(longer, 1, Decoding(sampling), torch.Generator().manual_seed(0))
    tiny.draft.reset()
    q_theirs = warp(tiny.draft.forward(longer)[-1], sampling)
    tiny.draft.reset()
    # float32 logits of two chunkings (T ~ 27): |dz| <= 2 eps32 S sum sqrt(n_i) = 8.8e-4, /0.8 (temperature);
    # softmax rel 2|dz| = 2.2e-3, + the fold's renormalising sum (259 eps32 = 1.5e-5). The top-50 cut-off gap is 9e-3
    assert torch.allclose(q_mine[0], q_theirs, rtol=2.5e-3, atol=0)
    # Through the loop: greedy output identical to plain decoding. (Random models write bytes that are not UTF-8;
    # those reach the draft as U+FFFD, so later rounds accept less — a real model does that only mid-character.)
    plain = generate(tiny.target, NoDrafter(), prompt, 32, k=0, timing=False)
    normal = generate(tiny.target, ModelDrafter(tiny.draft), prompt, 32, k=4, timing=False)
    remapped = generate(tiny.target, drafter, prompt, 32, k=4, timing=False)
    assert remapped.tokens == plain.tokens
    assert remapped.rounds[0].tokens == normal.rounds[0].tokens
    assert remapped.rounds[0].accepted == normal.rounds[0].accepted


class ScriptedDraft:
    """A stand-in draft model with a 300-id vocabulary (41 ids beyond the target's): its logits depend only on the
    last id fed, through a fixed random table, with a strong preference `favourite[last]`."""

    def __init__(self, vocab: int = 300, favourite: dict | None = None):
        self.vocab, self.device, self.length, self.max_length = vocab, torch.device("cpu"), 0, 4096
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(7))
        for last, fav in (favourite or {}).items():
            self.table[last, fav] = 30.0

    def forward(self, ids, keep=None):
        ids = list(ids)
        self.length += len(ids)
        return self.table[ids][-(keep or len(ids)):]

    def rollback(self, length):
        self.length = length

    def reset(self):
        self.length = 0


def test_larger_draft_vocabulary_never_reaches_the_target(tiny, prompt):
    target_vocab = tiny.target.vocab
    draft_tok = shuffled_byte_tokenizer(list(range(target_vocab)), extra=41)
    a, b = tiny.tokenizer.convert_tokens_to_ids(["a", "b"])
    draft = ScriptedDraft(favourite={prompt[-1]: a, a: b, b: 280})  # ... then an id the target does not have
    drafter = RemappedDrafter(draft, draft_tok, tiny.tokenizer, target_vocab)
    drafts, q, *_ = drafter.propose(prompt, 4, Decoding(Sampling()), None)
    assert drafts.tolist() == [a, b]  # stopped at the unmappable 280
    # Sampling: q is the draft's distribution folded onto the target's ids and renormalised.
    drafter.rollback(0)
    drafts, q, *_ = drafter.propose(prompt, 1, Decoding(Sampling(1.0)), torch.Generator().manual_seed(0))
    q_draft = draft.table[prompt[-1]].softmax(-1)
    assert q.shape == (1, target_vocab)
    # float32: the same 259 values over their sum, summed in any order: worst case 259 eps32 = 1.5e-5 relative
    assert torch.allclose(q[0], q_draft[:target_vocab] / q_draft[:target_vocab].sum(), rtol=1.6e-5, atol=0)
    # Through the whole loop, greedy and sampled: nothing out of range, greedy identity holds.
    draft = ScriptedDraft()
    drafter = RemappedDrafter(draft, draft_tok, tiny.tokenizer, target_vocab)
    plain = generate(tiny.target, NoDrafter(), prompt, 24, k=0, timing=False).tokens
    assert generate(tiny.target, drafter, prompt, 24, k=4, timing=False).tokens == plain
    out = generate(tiny.target, drafter, prompt, 24, k=4, sampling=Sampling(1.0),
                   generator=torch.Generator().manual_seed(1), timing=False)
    assert len(out.tokens) == 24 and max(out.tokens) < target_vocab
