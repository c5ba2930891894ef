"""The KV cache, with one rollback call.

Speculation writes draft tokens into the cache that may be rejected, so every cache used
by draftwise must be able to forget its tail. Caches that cannot (sliding-window layers
that already dropped old entries, recurrent state) are refused up front instead of
producing silently wrong output later.
"""

from __future__ import annotations

from transformers import DynamicCache, PretrainedConfig

from draftwise.errors import ModelLoadError


class CacheRollbackError(ModelLoadError, RuntimeError):
    """The model's cache cannot be rolled back, so it cannot be used for speculation.

    A user's error, not a bug: it is raised when such a model is loaded (the model type the
    user chose has sliding-window or recurrent layers), so it is a ``ModelLoadError``.
    """


class KVCache:
    """A growing key/value cache that can be cut back to any earlier length."""

    def __init__(self, config: PretrainedConfig) -> None:
        self._config = config
        self.hf = DynamicCache(config=config)
        if not self.hf.is_croppable:
            raise CacheRollbackError(
                f"the KV cache of model type {config.model_type!r} cannot be rolled back "
                "(sliding-window or recurrent layers); speculative decoding needs a cache that can"
            )

    @property
    def length(self) -> int:
        """Number of positions currently held."""
        return self.hf.get_seq_length()

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions and forget the rest (a view, no copy)."""
        current = self.length
        if length < 0 or length > current:
            raise ValueError(f"cannot roll back a cache of length {current} to {length}")
        if length < current:
            self.hf.crop(length - current)

    def reset(self) -> None:
        self.hf = DynamicCache(config=self._config)
