"""SamplingParams validation and the per-request sampler, on hand-made logits rows."""

from __future__ import annotations

import math

import pytest
import torch

from kvstrata.engine.sampling import SamplingParams, TokenSampler
from kvstrata.errors import ConfigError

ROW = torch.tensor([0.30, -0.01, 0.25, float("-inf"), 0.10])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"top_logprobs": 3}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_invalid_params_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_normalise_stop_and_seed() -> None:
    params = SamplingParams(stop="END", seed=-1)  # type: ignore[arg-type]
    assert params.stop == ("END",)
    assert params.seed == 2**64 - 1  # any integer is a seed; torch takes 0..2**64-1
    assert SamplingParams(seed=2**70 + 5).seed == 5
    assert [params.for_choice(i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert SamplingParams().for_choice(2).seed is None


def test_greedy_picks_the_best_allowed_token() -> None:
    sampler = TokenSampler(SamplingParams())
    assert sampler.choose(ROW).token == 0
    assert sampler.choose(ROW, banned=[0]).token == 2
    allowed = torch.tensor([False, True, False, False, True])
    assert sampler.choose(ROW, allowed=allowed).token == 4


def test_sampling_at_a_tiny_temperature_is_greedy_not_nan() -> None:
    """Found by the server fuzz test: temperature 4e-106 overflowed logits / T to inf (nan probs)."""
    for temperature in (3.9e-106, 1e-300, 5e-324):
        assert TokenSampler(SamplingParams(temperature=temperature, seed=0)).choose(ROW).token == 0


def test_the_same_seed_draws_the_same_tokens() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))

    def draws(seed: int) -> list[int]:
        sampler = TokenSampler(SamplingParams(temperature=1.5, seed=seed))
        return [sampler.choose(logits).token for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = TokenSampler(SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    # 0.5 + 0.3 reach 0.8: tokens 2 and 3 are never drawn
    assert {sampler.choose(logits).token for _ in range(300)} == {0, 1}
    tight = TokenSampler(SamplingParams(temperature=1.0, top_p=0.01, seed=3))
    assert {tight.choose(logits).token for _ in range(50)} == {0}


def test_presence_and_frequency_penalties_count_generated_tokens() -> None:
    logits = torch.tensor([1.0, 0.9, 0.0])
    sampler = TokenSampler(SamplingParams(presence_penalty=0.05, frequency_penalty=0.04))
    assert sampler.choose(logits).token == 0
    sampler.accept(0)  # token 0 now scores 1.0 - 0.05 - 0.04 = 0.91 > 0.9
    assert sampler.choose(logits).token == 0
    sampler.accept(0)  # 1.0 - 0.05 - 0.08 = 0.87 < 0.9
    assert sampler.choose(logits).token == 1


def test_logprobs_are_the_raw_log_softmax_and_the_top_ones_best_first() -> None:
    logits = torch.tensor([2.0, 0.5, 1.0, -1.0])
    sampler = TokenSampler(SamplingParams(logprobs=True, top_logprobs=2, presence_penalty=2.0))
    expected = torch.log_softmax(logits, dim=-1)
    choice = sampler.choose(logits)
    assert choice.token == 0 and choice.logprob == pytest.approx(float(expected[0]), abs=1e-6)
    assert [t for t, _ in choice.top_logprobs] == [0, 2]
    sampler.accept(0)
    # the penalty changes the choice, not the reported (raw) log-probabilities
    second = sampler.choose(logits)
    assert second.token == 2 and second.logprob == pytest.approx(float(expected[2]), abs=1e-6)


def test_logit_bias_is_added_to_the_scores() -> None:
    assert TokenSampler(SamplingParams(logit_bias=((4, 0.25),))).choose(ROW).token == 4  # 0.35 > 0.30
    assert TokenSampler(SamplingParams(logit_bias=((0, -100.0),))).choose(ROW).token == 2
    with pytest.raises(ConfigError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


def test_repetition_penalty_counts_the_prompt_and_the_output() -> None:
    """vLLM's rule: a seen token's positive score is divided by the penalty, a negative one multiplied."""
    penalty = SamplingParams(repetition_penalty=2.0)
    assert TokenSampler(penalty, prompt_ids=[0]).choose(ROW).token == 2  # 0.15 < 0.25
    sampler = TokenSampler(penalty, prompt_ids=[0])
    sampler.accept(2)
    assert sampler.choose(ROW).token == 0  # 0.15 > 0.125
    assert TokenSampler(SamplingParams(repetition_penalty=0.5), prompt_ids=[2]).choose(ROW).token == 2  # 0.5
    with pytest.raises(ConfigError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)


def test_top_k_samples_only_the_best_tokens() -> None:
    drawn = {
        TokenSampler(SamplingParams(temperature=5.0, top_k=2, seed=s)).choose(ROW).token for s in range(40)
    }
    assert drawn == {0, 2}
    wide = {
        TokenSampler(SamplingParams(temperature=5.0, top_k=-1, seed=s)).choose(ROW).token for s in range(40)
    }
    assert wide == {0, 1, 2, 4}
