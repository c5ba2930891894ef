"""Requests to engine inputs: chat templates, request defaults, speculation overrides."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from draftwise.api.errors import APIError
from draftwise.api.schemas import ChatCompletionRequest, CompletionRequest
from draftwise.api.settings import ServerSettings
from draftwise.api.translate import encode_chat, plan
from draftwise.backends.tiny import tiny_tokenizer
from draftwise.config import DraftConfig, GenerationConfig

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{% endif %}{{ m['content'] }}{% endfor %}"
)


def _chat(*messages: tuple[str, str]) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": r, "content": c} for r, c in messages])


def test_chat_uses_the_tokenizers_template():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    ids = encode_chat(_chat(("developer", "be brief"), ("user", "hi")), tokenizer)
    # "developer" is OpenAI's newer name for "system"; the generation prompt is appended.
    assert tokenizer.decode(ids) == "<system>be brief</system><user>hi</user><assistant>"


def test_chat_template_refusal_is_a_400():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = STRICT_TEMPLATE
    with pytest.raises(APIError) as refused:
        encode_chat(_chat(("user", "hi"), ("system", "late")), tokenizer)
    assert refused.value.status == 400 and "system message must come first" in refused.value.body.message


def test_chat_text_parts_are_joined(tiny_target):
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    )
    assert tiny_target.tokenizer.decode(encode_chat(request, tiny_target.tokenizer)) == "user: ab\nassistant:"


def test_plan_defaults_overrides_and_context():
    settings = ServerSettings(
        target="t",
        draft="d",
        generation=GenerationConfig(max_new_tokens=50, draft=DraftConfig(k_policy="heuristic", k=3)),
    )
    request = CompletionRequest(
        model="t",
        prompt="x",
        temperature=0,
        stop="END",
        speculative={"k": 6, "confidence_threshold": 0.2, "provenance": True},
    )
    p = plan(request, [1, 2, 3], settings, context_limit=1000, has_draft=True)
    assert p.drafter == "hybrid" and p.provenance  # the default with a draft model
    assert p.config.max_new_tokens == 50 and p.config.stop == ("END",)
    assert p.config.sampling.greedy
    # Overridden knobs change, the others keep the server's defaults.
    assert (p.config.draft.k, p.config.draft.confidence_threshold, p.config.draft.k_policy) == (6, 0.2, "heuristic")
    # Without max_tokens the completion fills what is left of the context.
    assert plan(request, [1] * 980, settings, context_limit=1000, has_draft=True).config.max_new_tokens == 20
    with pytest.raises(APIError, match="maximum context length is 1000"):
        plan(request, [1] * 1000, settings, context_limit=1000, has_draft=True)
    off = CompletionRequest(model="t", prompt="x", max_tokens=7, speculative={"drafter": "off"})
    assert plan(off, [1], settings, context_limit=None, has_draft=True).drafter == "off"


def test_settings_reject_model_drafter_without_draft():
    with pytest.raises(ValueError, match="needs a draft model"):
        ServerSettings(target="t", drafter="model")
    assert ServerSettings(target="t").default_drafter == "ngram"
    assert ServerSettings(target="t", draft="d").default_drafter == "hybrid"


def test_a_list_of_one_prompt_is_that_prompt():
    assert CompletionRequest(model="m", prompt=["hello"]).prompt == "hello"
    assert CompletionRequest(model="m", prompt=[104, 105]).prompt == [104, 105]
