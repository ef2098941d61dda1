"""t1: load a target/draft pair, check that they can speculate together, and say hello.

Loads both models (the embedded default pair offline, or any pair the flags name), shows where each came from and
how long it took, checks that the tokenizers agree (same strings -> same ids; padded embedding rows are cut away),
then has the target answer one prompt with plain greedy decoding and prints its speed.

    python -m spec.check_pair
    python -m spec.check_pair --pair llama
"""

from __future__ import annotations

import argparse

from spec.cli import add_model_args, load_from_args
from spec.drafters import NoDrafter
from spec.io import save_json
from spec.loop import generate
from spec.models import chat_ids, dtype_name, sync_time
from spec.models.quant_report import describe


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m spec.check_pair", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    pair = load_from_args(args)
    target, draft, tok = pair.target, pair.draft, pair.tokenizer

    def rows(model) -> int:
        return model.model.config.get_text_config().vocab_size

    print(f"pair      {pair.name} ({pair.why})")
    print(f"device    {pair.device}, {dtype_name(pair.dtype)}" + (f", {pair.draft_quant} draft weights"
                                                                   if pair.draft_quant != "none" else "")
          + (f", {pair.target_quant} TARGET weights (a changed model)" if pair.target_quant != "none" else ""))
    if pair.target_report:
        print(f"quantized {describe(pair.target_report, dtype_name(pair.dtype))}")
    print(f"target    {target.weight_bytes() / 1e9:.2f} GB, {rows(target):,} embedding rows, "
          f"loaded in {pair.load_seconds['target']:.1f} s")
    if draft is not None:
        print(f"draft     {draft.weight_bytes() / 1e9:.2f} GB, {rows(draft):,} embedding rows, "
              f"loaded in {pair.load_seconds['draft']:.1f} s")
        same = pair.draft_tokenizer is None
        print(f"tokenizer {'identical vocabularies' if same else 'DIFFERENT families (ids remapped)'}: "
              f"{len(tok):,} tokens; logits cut to {target.vocab:,} columns")
    print(f"EOS ids   {sorted(pair.eos)}")
    ids = chat_ids(tok, args.prompt)
    start = sync_time(pair.device)
    result = generate(target, NoDrafter(pair.device), ids, args.max_new_tokens, k=0, eos=pair.eos)
    seconds = sync_time(pair.device) - start
    print(f"\n> {args.prompt}\n{tok.decode(result.tokens, skip_special_tokens=True)}\n")
    print(f"plain greedy: {len(result.tokens)} tokens in {seconds:.2f} s ({len(result.tokens) / seconds:.2f} tok/s, "
          f"prompt of {len(ids)} tokens prefilled in {result.prefill_s:.2f} s)")
    out = {"task": "check_pair", "pair": pair.name, "why": pair.why, "device": str(pair.device),
           "dtype": dtype_name(pair.dtype), **pair.setup_fields(), "load_seconds": pair.load_seconds,
           "vocab": target.vocab, "tokens": len(result.tokens), "seconds": seconds,
           "tok_s": len(result.tokens) / seconds}
    print(f"saved {save_json('check_pair', out)}")
    return out


if __name__ == "__main__":
    main()
