"""Build the tiny character-level tokenizer of the CPU demo, locally (no hub download).

One token per printable ASCII character plus newline, and a few special tokens for a simple chat
template: ~105 ids, under the vocabularies of configs/models/ (qwen3_moe 256, mixtral 250), so the
tiny random models can be trained on real text-in, text-out tasks.

    python tools/make_tiny_tokenizer.py [--out configs/tokenizers/tiny_char]
"""
from __future__ import annotations

import argparse
import string

SPECIALS = ["<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# <|end|> closes every turn and is the EOS, so generation stops where the assistant's turn ends.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def build():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable + "\n"
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    # BPE without merges = one token per character; Fuse joins them back without spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)  # matched whole, before the character split
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|end|>", chat_template=CHAT_TEMPLATE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="configs/tokenizers/tiny_char")
    args = ap.parse_args()
    tok = build()
    tok.save_pretrained(args.out)
    print(f"wrote {args.out}: vocab {len(tok)}")


if __name__ == "__main__":
    main()
