"""Typed configuration: unknown keys and bad values fail when the object is built."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from draftwise import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.config import MIN_TEMPERATURE


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (GenerationConfig, {"max_tokens": 5}),
        (SamplingConfig, {"temp": 0.5}),
        (DraftConfig, {"policy": "fixed"}),
    ],
)
def test_unknown_keys_are_rejected(cls, kwargs):
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        cls(**kwargs)


def test_unknown_nested_keys_are_rejected():
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate({"sampling": {"temperature": 0.5, "topk": 3}})
    with pytest.raises(ValidationError):
        GenerationConfig.model_validate({"draft": {"k": 2, "kk": 3}})


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (SamplingConfig, {"temperature": -0.1}),
        (SamplingConfig, {"top_p": 0.0}),
        (SamplingConfig, {"top_p": 1.5}),
        (SamplingConfig, {"top_k": -1}),
        (SamplingConfig, {"seed": -3}),
        (DraftConfig, {"ngram_min": 3, "ngram_max": 2}),
        (DraftConfig, {"k_policy": "greedy"}),
        (DraftConfig, {"k": -1}),
        (DraftConfig, {"k_policy": "heuristic", "k": 9, "k_max": 4}),
        (DraftConfig, {"confidence_threshold": 1.5}),
        (GenerationConfig, {"max_new_tokens": 0}),
        (GenerationConfig, {"stop": ("ok", "")}),
    ],
)
def test_bad_values_are_rejected(cls, kwargs):
    with pytest.raises(ValidationError):
        cls(**kwargs)


def test_good_values_and_defaults():
    cfg = GenerationConfig.model_validate(
        {
            "max_new_tokens": 7,
            "stop": ["\n\n"],
            "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 1},
            "draft": {"k_policy": "fixed", "k": 20, "k_max": 4},
        }
    )
    assert cfg.stop == ("\n\n",) and cfg.sampling.top_p == 0.9 and not cfg.sampling.greedy
    assert cfg.draft.k == 20  # fixed k may exceed k_max: k_max only bounds the adaptive policies
    assert GenerationConfig().sampling.greedy
    assert DraftConfig().confidence_threshold == 0.6


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, MIN_TEMPERATURE / 10])
def test_a_positive_temperature_below_the_floor_is_raised_to_it(temperature):
    sampling = SamplingConfig(temperature=temperature)
    assert sampling.temperature == MIN_TEMPERATURE and not sampling.greedy
    # The rule is idempotent, so a config sent elsewhere (a remote verifier) validates the same.
    assert SamplingConfig.model_validate(sampling.model_dump()) == sampling


def test_temperatures_at_or_above_the_floor_are_kept():
    assert SamplingConfig(temperature=0.0).greedy
    assert SamplingConfig(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    assert SamplingConfig(temperature=0.3).temperature == 0.3


def test_configs_are_frozen():
    cfg = GenerationConfig()
    with pytest.raises(ValidationError):
        cfg.max_new_tokens = 3
