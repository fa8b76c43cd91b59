"""Character-level tokenizer for the addition demo, built locally with the `tokenizers` library.

Consumes: nothing (no download). Produces: a `PreTrainedTokenizerFast` whose vocabulary is the special tokens
`<pad>` (id 0), `<bos>` (1), `<eos>` (2), then the digits 0-9 (ids 3-12), `+` (13) and `=` (14).

Guarantees:
- Every character is one token (a `Split` pre-tokenizer on "" with the `isolated` behaviour); decoding joins
  the characters back with nothing in between (`Fuse` decoder), so `decode(encode(text))` is `text`.
- Encoding prepends `<bos>` (as vLLM and `generate` do with their default `add_special_tokens=True`); no
  `<eos>` is appended: the model has to produce it.
- A character outside the vocabulary raises (there is no unknown token that could hide a malformed prompt).
- Padding is on the left, as generation needs; `save_pretrained` output reloads with `AutoTokenizer` offline.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
CHARACTERS = tuple("0123456789+=")
MAX_LENGTH = 64


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer (15 tokens) for `a+b=` prompts and digit answers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        model_max_length=MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    return tokenizer
