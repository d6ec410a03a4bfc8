"""A byte-level BPE tokenizer built here (no downloads) that can spell any text, JSON included, with a few
merges so that JSON's punctuation has several spellings ('{"' one token or two), and a tiny random Qwen4Exp
of its vocabulary: what the structured-output tests constrain (tests/test_serve.py's word-level tokenizer
cannot spell JSON)."""

from __future__ import annotations

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
EOS = 3
MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), (":", '"'), ("r", "e"), ("e", "d"), ("t", "r"), ("tr", "u"),
          ("tru", "e"), ("Ġ", "w")]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_json_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL + alphabet)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", additional_special_tokens=SPECIAL[4:])
    fast.chat_template = TEMPLATE
    return fast


def make_json_model(tokenizer, seed: int = 0, **overrides):
    """A random tiny Qwen4Exp whose vocabulary is the tokenizer's (tests/test_serve.py's ``make_model``: EOS 3,
    its norms and PLE conv randomised)."""
    from test_serve import make_model

    return make_model(seed, vocab_size=len(tokenizer), **overrides)
