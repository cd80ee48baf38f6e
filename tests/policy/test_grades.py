"""Grades inside one agent: recent blocks exact, the system prompt and the most attended top,
the least attended bottom, by exact block indices."""

from __future__ import annotations

import pytest

from kvstrata.errors import ConfigError
from kvstrata.policy.grades import Grade, GradedCodecs, grade_blocks

T, M, B, R = Grade.TOP, Grade.MIDDLE, Grade.BOTTOM, Grade.RECENT


def test_blocks_are_graded_by_score_and_the_recent_ones_stay_exact() -> None:
    scores = [0.9, 0.1, 0.5, 0.05, 0.3, 0.2, 0.8, 0.7, 0.6, 0.4, 0.0, 0.0]
    grades = grade_blocks(scores, recent_from=10, top_share=0.2, bottom_share=0.3)
    # of blocks 0-9: top 2 by score (0, 6), bottom 3 (3, 1, 5), the rest middle; 10-11 recent
    assert grades == [T, B, M, B, M, B, T, M, M, M, R, R]


def test_the_system_prompt_is_top_and_counts_in_the_top_share() -> None:
    scores = [0.0, 0.0, 0.9, 0.8, 0.1, 0.2]
    grades = grade_blocks(scores, recent_from=5, top_share=0.4, bottom_share=0.2, protected=[0, 1])
    assert grades == [T, T, M, M, B, R]


def test_ties_rank_the_earlier_block_higher() -> None:
    assert grade_blocks([1.0] * 4, recent_from=4, top_share=0.25, bottom_share=0.25) == [T, M, M, B]


def test_the_rung_maps_grades_to_codecs_and_checks_its_shares() -> None:
    rung = GradedCodecs("int8s", "kivi4", "kivi2", 0.1, 0.5)
    assert [rung.codec_for(g) for g in (T, M, B, R)] == ["int8s", "kivi4", "kivi2", None]
    with pytest.raises(ConfigError, match="must not exceed 1"):
        GradedCodecs(top_share=0.6, bottom_share=0.5)
    with pytest.raises(ConfigError, match="bottom_share"):
        GradedCodecs(bottom_share=-0.1)
