"""The demo's fault-schedule parser and its checks against the run's shape."""

from __future__ import annotations

import pytest

from trainguard._demo._schedule import DEFAULT_FAULTS, FaultSpec, parse_faults, validate_faults
from trainguard.errors import ConfigError


def test_default_schedule_parses_to_three_kinds_on_three_ranks():
    faults = parse_faults(DEFAULT_FAULTS)
    assert faults == [
        FaultSpec("exception", 1, 40), FaultSpec("hang", 2, 80), FaultSpec("sigkill", 3, 120)
    ]
    validate_faults(faults, ranks=4, reserve=1, steps=160)


@pytest.mark.parametrize("text", ["none", "NONE", "", "  none "])
def test_none_means_no_faults(text):
    assert parse_faults(text) == []


def test_whitespace_around_items_is_ignored():
    assert parse_faults(" hang@rank2:step5 , sigkill@rank1:step9") == [
        FaultSpec("hang", 2, 5), FaultSpec("sigkill", 1, 9)
    ]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("exception@1:40", "expected KIND@rankR:stepS"),
        ("exception@rank1", "expected KIND@rankR:stepS"),
        ("exception@rank-1:step4", "expected KIND@rankR:stepS"),
        ("explode@rank1:step4", "unknown kind 'explode'"),
        ("hang@rank1:step0", "numbered from 1"),
        ("hang@rank1:step4,sigkill@rank1:step4", "already has a fault at step 4"),
        ("hang@rank1:step4,,", "expected KIND@rankR:stepS"),
    ],
)
def test_bad_items_say_what_is_wrong(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_faults(text)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("hang@rank5:step4", "rank 5 does not exist"),
        ("hang@rank1:step200", "past the last step"),
        (",".join(f"sigkill@rank{r}:step{s}" for r, s in ((0, 3), (1, 4), (2, 5), (3, 6), (4, 7))),
         "would remove all 5 ranks"),
        ("sigkill@rank2:step5,exception@rank2:step9", "killed at step 5, so a later fault"),
    ],
)
def test_schedule_is_checked_against_the_run(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_faults(parse_faults(text), ranks=4, reserve=1, steps=160)


def test_every_kind_is_allowed_on_rank0():
    faults = parse_faults("exception@rank0:step3,hang@rank0:step6,sigkill@rank0:step9")
    validate_faults(faults, ranks=2, reserve=0, steps=10)


def test_fault_spec_round_trips_through_json():
    spec = FaultSpec("hang", 2, 80)
    assert FaultSpec.from_json(spec.to_json()) == spec
    assert spec.label == "hang@rank2:step80"
