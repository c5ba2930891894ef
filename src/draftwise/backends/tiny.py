"""Tiny random models built in-process: for tests, demos and smoke runs without downloads.

``tiny_lm(seed)`` gives a small Llama with a byte-level tokenizer (256 byte tokens + EOS).
Two calls with the same seed give the same weights, so "draft == target" is easy to set up,
and different seeds give an unrelated drafter.
"""

from __future__ import annotations

import torch

from draftwise.backends.hf import HFModel, HFTokenizer

EOS = "<|eos|>"


def tiny_tokenizer() -> HFTokenizer:
    """A byte-level tokenizer with no merges: every byte is a token, plus EOS (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS))


def tiny_lm(seed: int = 0, layers: int = 2, hidden: int = 64, init_scale: float = 0.15) -> HFModel:
    """A random Llama over the tiny tokenizer, in float32.

    ``init_scale`` (the weights' standard deviation) is larger than usual so the random
    model's next-token distributions are peaked, which keeps greedy argmax ties rare.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
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
