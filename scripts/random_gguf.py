"""Write a GGUF model of a known shape with random weights and a real tokenizer, whose greedy
output is known in advance.

For measurements where no real weights can travel (the device check, scripts/cuda_check.py): a
pass costs what the shape costs, whatever the weights' values, so a file of Qwen2.5-Coder's
shapes prices passes as the real model does. What the weights decide is what the model says,
and with weights drawn at random that is a poor place to measure speculation: the top two
scores are close (a tenth of their spread), so a block and one-token decoding, whose kernels
round apart, pick different tokens every few dozen, and an answer sent back as its prediction
stops matching.

So the weights are built to walk: the blocks are near zero (N(0, 2e-4^2): the residual stream
stays the current token's embedding) and the output matrix scores, after token t, the token
``walk(t)`` some thirty spreads above any other, a margin no rounding reaches. ``walk`` maps
every token to a word token (a space and three or more lowercase letters), through a random
permutation of those, so an answer does not repeat for thousands of tokens, and its text
tokenizes back into the same tokens (what a prediction sent as text needs). A draft model made
with ``--agree P`` walks as the target with ``--walk`` of the same seed on a share ``P`` of
tokens: a drafter right that often, by construction.

The tokenizer (every ``tokenizer.*`` key) comes from another GGUF file: llama.cpp ships one per
tokenizer family with its sources (``models/ggml-vocab-qwen2.gguf``), a few MB against the
model's GB. Weights are float16 (norms float32); quantize the file with llama.cpp's
``llama-quantize`` for a model of the real file's size.

    python scripts/random_gguf.py --vocab ggml-vocab-qwen2.gguf --shape qwen2.5-1.5b --out t.gguf
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A qwen2 model's shape: what llama.cpp needs to build its graph."""

    layers: int
    width: int  # embedding length
    ffn: int  # feed-forward length
    heads: int
    kv_heads: int


# Read from the packaged GGUF files of the default pair (qwen2.5-coder-1.5b and 0.5b); tiny is
# for tests, where the file must load and run in a second.
SHAPES = {
    "qwen2.5-1.5b": Shape(layers=28, width=1536, ffn=8960, heads=12, kv_heads=2),
    "qwen2.5-0.5b": Shape(layers=24, width=896, ffn=4864, heads=14, kv_heads=2),
    "tiny": Shape(layers=2, width=256, ffn=512, heads=4, kv_heads=2),
}
CONTEXT = 32768
END_OF_TURN = "<|im_end|>"  # the chat template's end of a turn: what a chat answer ends with


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """The qwen2 tensors of ``shape``, by name, with their numpy shapes ([rows, columns]: GGUF
    lists the same dimensions in the other order)."""
    head = shape.width // shape.heads
    kv = shape.kv_heads * head
    named = [("token_embd.weight", (vocab, shape.width)), ("output_norm.weight", (shape.width,))]
    named.append(("output.weight", (vocab, shape.width)))
    for i in range(shape.layers):
        block = f"blk.{i}."
        named += [
            (block + "attn_norm.weight", (shape.width,)),
            (block + "attn_q.weight", (shape.width, shape.width)),
            (block + "attn_q.bias", (shape.width,)),
            (block + "attn_k.weight", (kv, shape.width)),
            (block + "attn_k.bias", (kv,)),
            (block + "attn_v.weight", (kv, shape.width)),
            (block + "attn_v.bias", (kv,)),
            (block + "attn_output.weight", (shape.width, shape.width)),
            (block + "ffn_norm.weight", (shape.width,)),
            (block + "ffn_gate.weight", (shape.ffn, shape.width)),
            (block + "ffn_up.weight", (shape.ffn, shape.width)),
            (block + "ffn_down.weight", (shape.width, shape.ffn)),
        ]
    return named


BLOCK_STD = 2e-4  # the blocks' weights: small enough that the residual stream stays the token's embedding
EMBEDDING_STD = 0.02
WORD = re.compile("\u0120[a-z]{3,}")  # byte-level BPE's space, then a lowercase word


def walk(tokens: list[str], seed: int, agree: float) -> np.ndarray:
    """``walk[t]``: the token that follows token ``t``. The word tokens follow each other in a
    random permutation (seed ``seed``), whose cycles are long; every other token leads to a
    word token drawn at random. With ``agree`` < 1, each token's successor is drawn again elsewhere with
    probability ``1 - agree`` (a draft that is right that often)."""
    words = np.array([i for i, token in enumerate(tokens) if WORD.fullmatch(token)], dtype=np.int64)
    if words.size < 2:
        raise SystemExit("error: the tokenizer has no word tokens (a space and lowercase letters) to walk through")
    rng = np.random.default_rng(seed)
    successor = words[rng.integers(0, words.size, size=len(tokens))]
    successor[words] = words[rng.permutation(words.size)]
    other = np.random.default_rng([seed, 1]).random(len(tokens)) >= agree
    successor[other] = words[np.random.default_rng([seed, 2]).integers(0, words.size, size=int(other.sum()))]
    return successor


def values(name: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms are ones (float32, as llama.cpp keeps them); biases zeros; the embedding
    N(0, 0.02^2); the blocks' matrices N(0, BLOCK_STD^2). (The output matrix: ``walk_output``.)"""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    if name.endswith(".bias"):
        return np.zeros(dims, dtype=np.float32)
    std = EMBEDDING_STD if name == "token_embd.weight" else BLOCK_STD
    return (rng.standard_normal(dims, dtype=np.float32) * std).astype(np.float16)


def walk_output(embedding: np.ndarray, successor: np.ndarray) -> np.ndarray:
    """The output matrix [V, width] whose row ``walk[t]`` holds the direction of ``t``'s
    embedding: after ``t`` (normalized, about ``e_t / rms(e_t)``) that token scores
    ``|e_t| * sqrt(width)``, about 30 for Qwen2.5-1.5B's shape, every other about 1 at most."""
    unit = embedding.astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    order = np.argsort(successor, kind="stable")
    rows, starts = np.unique(successor[order], return_index=True)
    output = np.zeros(unit.shape, dtype=np.float16)
    output[rows] = np.add.reduceat(unit[order], starts, axis=0)  # the sum over each row's predecessors
    return output


def copy_tokenizer(reader, writer) -> int:
    """Every ``tokenizer.*`` key of ``reader`` into ``writer``, the end of generation set to the
    chat template's end of turn (as in the real files: a chat answer ends there); returns the
    vocabulary's size."""
    import gguf

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SystemExit(f"error: {reader.path} holds no tokenizer (tokenizer.ggml.tokens)")
    names = tokens.contents()
    eos = names.index(END_OF_TURN) if END_OF_TURN in names else None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or (key == "tokenizer.ggml.eos_token_id" and eos is not None):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), kind)
    if eos is not None:
        writer.add_eos_token_id(eos)
    return list(names)


def write(vocab_file: Path, shape_name: str, out: Path, seed: int, walk_seed: int, agree: float) -> None:
    import gguf

    shape = SHAPES[shape_name]
    reader = gguf.GGUFReader(str(vocab_file))
    writer = gguf.GGUFWriter(str(out), "qwen2")
    writer.add_name(f"random {shape_name} (seed {seed}, walk {walk_seed}, agree {agree:g})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(shape.width)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens = copy_tokenizer(reader, writer)
    rng = np.random.default_rng(seed)
    embedding = values("token_embd.weight", (len(tokens), shape.width), rng)
    # Every block holds the same draws: their values are near zero and change no pass's cost,
    # and drawing a 1.5B model's blocks one by one takes most of a minute.
    block: dict[str, np.ndarray] = {}
    for name, dims in tensors(shape, len(tokens)):
        if name == "token_embd.weight":
            writer.add_tensor(name, embedding)
        elif name == "output.weight":
            writer.add_tensor(name, walk_output(embedding, walk(tokens, walk_seed, agree)))
        else:
            kind = name.split(".", 2)[-1]  # blk.3.attn_q.weight -> attn_q.weight
            if kind not in block:
                block[kind] = values(name, dims, rng)
            writer.add_tensor(name, block[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=Path, required=True, help="a GGUF file whose tokenizer the model takes")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the model's shape")
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write (float16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights")
    parser.add_argument("--walk", type=int, default=0, help="seed of the walk: which token follows which")
    parser.add_argument("--agree", type=float, default=1.0, help="share of tokens followed as --walk says (a draft)")
    args = parser.parse_args(argv)
    if not args.vocab.is_file():
        print(f"error: no file {args.vocab}", file=sys.stderr)
        return 2
    if not 0.0 <= args.agree <= 1.0:
        print(f"error: --agree is a share between 0 and 1, not {args.agree:g}", file=sys.stderr)
        return 2
    write(args.vocab, args.shape, args.out, args.seed, args.walk, args.agree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
