"""The ``hf`` backend: transformers causal LMs (folders, Hugging Face ids, GGUF files dequantized
by transformers, tiny in-process models) behind the ``LanguageModel`` seam.

Weights may be float32 packed for oneDNN or weight-quantized (``draftwise.backends.quant``);
on a machine with a CUDA device (``device="cuda"``) they run there.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from draftwise.backends.hf_kv_cache import KVCache


class HFTokenizer:
    """A transformers tokenizer behind the seam's ``Tokenizer`` protocol, safe to share
    between threads: the fast (Rust) tokenizers refuse concurrent use ("Already borrowed"),
    so every call takes a lock (calls are short; forks share one tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self._lock = threading.Lock()

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        self.hf.chat_template = value

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.hf, "eos_token_id", None)

    @property
    def pad_token_id(self) -> int | None:
        return getattr(self.hf, "pad_token_id", None)

    def __len__(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def control_tokens(self) -> dict[str, int]:
        """The special added tokens (``<|im_start|>``, EOS...); added tokens that are not
        special are words of the vocabulary, read out of any text."""
        with self._lock:
            added = dict(self.hf.added_tokens_decoder)
        return {token.content: index for index, token in sorted(added.items()) if token.special and token.content}

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]:
        with self._lock:
            return list(
                self.hf.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=not parse_special)
            )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with self._lock:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        with self._lock:
            return self.hf.apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt, tools=tools
            )

    def get_vocab(self) -> dict[str, int]:
        with self._lock:
            return dict(self.hf.get_vocab())

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes: byte-level BPE pieces through the byte alphabet, SentencePiece
        pieces with their word mark as a space and their byte tokens (``<0x0A>``) as bytes."""
        with self._lock:
            pieces = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
            decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        alphabet = {symbol: byte for byte, symbol in _byte_alphabet().items()}
        out = []
        for piece in pieces:
            piece = piece or ""
            if byte_level and all(ch in alphabet for ch in piece):
                out.append(bytes(alphabet[ch] for ch in piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1
    bytes stand for themselves, the others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFModel:
    """A transformers causal LM plus its KV cache, for a single sequence (batch size 1)."""

    last_pass = None  # every forward runs alone (see LanguageModel.last_pass)
    kernel_timing = None  # torch picks its own kernels (see LanguageModel.kernel_timing)
    batch = None  # (see LanguageModel.batch)

    backend = "hf"

    def __init__(self, model: Any, tokenizer: Any = None, name: str | None = None) -> None:
        self.model = model.eval()
        if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
            tokenizer = HFTokenizer(tokenizer)
        self.tokenizer: HFTokenizer | None = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", None) or model.config.model_type
        self.cache = KVCache(model.config)
        self.tokens: list[int] = []
        self.device = next(model.parameters()).device

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the width of every score row ``forward`` returns.

        Read from the layer's ``out_features``, which dense, packed (``PackedLinear``) and
        quantized (``Int8Linear``, ``Int4Linear``) output layers all carry; only the dense one
        has a ``.weight``.
        """
        head = self.model.get_output_embeddings()
        return int(getattr(head, "out_features", None) or self.config.vocab_size)

    @property
    def max_context(self) -> int | None:
        """Positions the model was built for (prompt + generated), if its config says."""
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def dtype(self) -> str:
        """The dtype activations flow in (``float32`` also for packed or weight-quantized layers)."""
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def fingerprint(self) -> str:
        head = type(self.model.get_output_embeddings()).__name__
        return f"hf|{self.name}|{self.dtype}|{self.device}|{torch.get_num_threads()} threads|{head}"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the generation config, the model config and the tokenizer, merged."""
        ids: set[int] = set()
        sources = [getattr(self.model, "generation_config", None), self.config, self.tokenizer]
        for source in sources:
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return tuple(sorted(ids))

    def fork(self) -> HFModel:
        """A new sequence over the same weights and tokenizer (nothing is copied)."""
        return HFModel(self.model, self.tokenizer, name=self.name)

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``tokens`` to the cache and return float32 scores ``[n, V]`` (on the CPU).

        ``last`` limits the scores to the final ``last`` positions: the output layer over a
        large vocabulary is costly, and a prefill only needs the final row.
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            cache=self.cache.hf,
            use_cache=True,
            logits_to_keep=last or 0,
        )
        self.tokens.extend(tokens)
        return out.logits[0].float().cpu()

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.cache.rollback(length)
        del self.tokens[length:]
