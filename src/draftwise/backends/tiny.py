"""Tiny random models built in-process: for tests, demos and smoke runs without downloads.

``tiny_lm(seed)`` gives a small Llama with a byte-level tokenizer (256 byte tokens + EOS), or
with another vocabulary (``tiny_tokenizer``'s merges and shuffled ids).
Two calls with the same seed give the same weights, so "draft == target" is easy to set up,
and different seeds give an unrelated drafter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.backends.hf import HFModel, HFTokenizer

EOS = "<|eos|>"


def tiny_tokenizer(merges: Sequence[tuple[str, str]] = (), shuffle: int | None = None) -> HFTokenizer:
    """A byte-level tokenizer: every byte is a token, plus EOS (id 256).

    ``merges`` (pairs of plain text, ``("th", "e")``) add BPE merges, each a token after EOS:
    a vocabulary of its own, for drafts that speak another one. ``shuffle`` (a seed) gives
    the byte tokens other ids: the same strings under another numbering.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if shuffle is not None:
        order = torch.randperm(len(alphabet), generator=torch.Generator().manual_seed(shuffle)).tolist()
        alphabet = [alphabet[i] for i in order]
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    as_symbols = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def spelt(text: str) -> str:  # in the byte alphabet: " t" is "Ġt"
        return "".join(piece for piece, _ in as_symbols.pre_tokenize_str(text))

    pairs = [(spelt(a), spelt(b)) for a, b in merges]
    for a, b in pairs:
        vocab.setdefault(a + b, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS))


def tiny_lm(
    seed: int = 0, layers: int = 2, hidden: int = 64, init_scale: float = 0.15, tokenizer: HFTokenizer | None = None
) -> HFModel:
    """A random Llama over ``tokenizer`` (the tiny byte tokenizer by default), in float32.

    ``init_scale`` (the weights' standard deviation) is larger than usual so the random
    model's next-token distributions are peaked, which keeps greedy argmax ties rare.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=init_scale,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return HFModel(model.float().eval(), tokenizer, name=f"tiny:{seed}")
