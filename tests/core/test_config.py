"""Strict config parsing: every bad input names the field and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from gnmr_dist import GNMRConfig, Schedule
from gnmr_dist.core.schedule import ScheduleKind


def test_defaults_match_design_example():
    cfg = GNMRConfig()
    assert (cfg.max_active, cfg.lock_steps, cfg.window, cfg.warmup_steps) == (4, 8, 8, 8)
    assert (cfg.alpha, cfg.beta) == (1.5, 2.0)


def test_round_trip_through_dict():
    d = {
        "max_active": 2,
        "lock_steps": 3,
        "window": 5,
        "warmup_steps": 0,
        "alpha": {"schedule": "cosine", "start": 3.0, "end": 1.5, "steps": 100},
        "beta": 2,
    }
    cfg = GNMRConfig.from_dict(d)
    assert isinstance(cfg.alpha, Schedule) and cfg.alpha.schedule is ScheduleKind.COSINE
    assert cfg.beta == 2.0 and isinstance(cfg.beta, float)
    assert GNMRConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.thresholds_at(1) == (3.0, 2.0) and cfg.thresholds_at(101) == (1.5, 2.0)


@pytest.mark.parametrize(
    "key, hint",
    [
        ("max_actve", "max_active"),
        ("lock_step", "lock_steps"),
        ("windw", "window"),
        ("warmup", "warmup_steps"),
        ("alpah", "alpha"),
    ],
)
def test_unknown_key_names_it_and_the_closest(key, hint):
    with pytest.raises(ValueError, match=rf"unknown key gnmr\.{key}; did you mean '{hint}'"):
        GNMRConfig.from_dict({key: 1})


def test_unknown_key_far_from_everything_lists_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key gnmr\.zzzz \(valid keys: alpha, beta"):
        GNMRConfig.from_dict({"zzzz": 1})


@pytest.mark.parametrize(
    "field, value, msg",
    [
        ("max_active", -1, r"gnmr\.max_active must be an integer >= 0, got -1"),
        ("max_active", 1.5, r"gnmr\.max_active must be an integer >= 0"),
        ("max_active", True, r"gnmr\.max_active must be an integer >= 0"),
        ("lock_steps", -3, r"gnmr\.lock_steps must be an integer >= 0"),
        ("window", 0, r"gnmr\.window must be an integer >= 1, got 0"),
        ("warmup_steps", "8", r"gnmr\.warmup_steps must be an integer >= 0"),
        ("alpha", 0, r"gnmr\.alpha must be a finite number > 0 or a schedule"),
        ("beta", -2.0, r"gnmr\.beta must be a finite number > 0"),
        ("alpha", float("inf"), r"gnmr\.alpha must be a finite number > 0"),
        ("alpha", float("nan"), r"gnmr\.alpha must be a finite number > 0"),
        ("alpha", "1.5", r"gnmr\.alpha must be a finite number > 0"),
    ],
)
def test_bad_values_name_field_and_range(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        GNMRConfig.from_dict({field: value})
    with pytest.raises(ValueError, match=msg):
        GNMRConfig(**{field: value})


@pytest.mark.parametrize(
    "schedule, msg",
    [
        (
            {"schedule": "exp", "start": 1, "end": 2, "steps": 3},
            r"gnmr\.alpha\.schedule must be one of \['constant', 'linear', 'cosine', 'step'\]",
        ),
        ({"schedule": "linear", "start": 1, "end": 2}, r"gnmr\.alpha is missing required key"),
        (
            {"schedule": "linear", "start": 1, "end": 2, "steps": 0},
            r"gnmr\.alpha\.steps must be an integer >= 1",
        ),
        (
            {"schedule": "linear", "start": -1, "end": 2, "steps": 5},
            r"gnmr\.alpha\.start must be a finite number > 0",
        ),
        (
            {"schedule": "linear", "start": 1, "end": 0, "steps": 5},
            r"gnmr\.alpha\.end must be a finite number > 0",
        ),
        (
            {"schedule": "linear", "start": 1, "end": 2, "steps": 5, "warm": 1},
            r"unknown key gnmr\.alpha\.warm",
        ),
        ([1, 2], r"gnmr\.alpha must be a finite number > 0"),
    ],
)
def test_malformed_schedule(schedule, msg):
    with pytest.raises(ValueError, match=msg):
        GNMRConfig.from_dict({"alpha": schedule})


def test_from_dict_rejects_non_mapping_and_uses_given_path():
    with pytest.raises(ValueError, match="gnmr must be a mapping"):
        GNMRConfig.from_dict([("max_active", 1)])
    with pytest.raises(ValueError, match=r"policy\.window must be an integer >= 1"):
        GNMRConfig.from_dict({"window": 0}, path="policy")
    with pytest.raises(ValueError, match=r"unknown key policy\.windw"):
        GNMRConfig.from_dict({"windw": 0}, path="policy")


def test_schedule_object_validates_itself():
    with pytest.raises(ValueError, match="schedule must be one of"):
        Schedule("exp", 1.0, 2.0, 3)
    with pytest.raises(ValueError, match="schedule steps must be an integer >= 1"):
        Schedule("linear", 1.0, 2.0, 0)
    cfg = GNMRConfig(alpha=Schedule("linear", 2.0, 1.0, 4))
    assert cfg.to_dict()["alpha"] == {"schedule": "linear", "start": 2.0, "end": 1.0, "steps": 4}


def test_config_is_frozen():
    cfg = GNMRConfig()
    frozen = dataclasses.FrozenInstanceError
    with pytest.raises(frozen, match="cannot assign to field 'max_active'"):
        cfg.max_active = 3  # type: ignore[misc]
    assert cfg.max_active == GNMRConfig().max_active == 4


# ------------------------------------------------ gamma (docs/algorithm.md#damage-term)

OLD_DEFAULT_DICT = {
    "max_active": 4,
    "lock_steps": 8,
    "window": 8,
    "alpha": 1.5,
    "beta": 2.0,
    "warmup_steps": 8,
}


def test_gamma_is_off_by_default_and_absent_from_the_json_form():
    cfg = GNMRConfig()
    assert cfg.gamma is None and cfg.gamma_at(1) is None
    # the JSON form of a config without gamma is exactly what it was before gamma existed
    assert cfg.to_dict() == OLD_DEFAULT_DICT
    assert GNMRConfig.from_dict(OLD_DEFAULT_DICT) == cfg
    assert GNMRConfig.from_dict({"gamma": None}) == cfg
    assert cfg.thresholds_at(3) == (1.5, 2.0)  # still a pair: callers index it


def test_gamma_number_and_schedule_round_trip():
    cfg = GNMRConfig.from_dict({"gamma": 2})
    assert cfg.gamma == 2.0 and isinstance(cfg.gamma, float)
    assert cfg.to_dict() == {**OLD_DEFAULT_DICT, "gamma": 2.0}
    assert GNMRConfig.from_dict(cfg.to_dict()) == cfg
    sched = {"schedule": "cosine", "start": 0.5, "end": 0.1, "steps": 10}
    cfg = GNMRConfig.from_dict({"gamma": sched})
    assert isinstance(cfg.gamma, Schedule) and cfg.gamma.schedule is ScheduleKind.COSINE
    assert cfg.to_dict()["gamma"] == sched and GNMRConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.gamma_at(1) == 0.5 and cfg.gamma_at(11) == 0.1
    assert GNMRConfig(gamma=Schedule("linear", 1.0, 2.0, 4)).gamma_at(3) == 1.5
    assert "gamma" in GNMRConfig.field_names()


@pytest.mark.parametrize(
    "value, msg",
    [
        (0, r"gnmr\.gamma must be a finite number > 0 or a schedule .*or null to leave"),
        (-1.0, r"gnmr\.gamma must be a finite number > 0"),
        (float("inf"), r"gnmr\.gamma must be a finite number > 0"),
        (float("nan"), r"gnmr\.gamma must be a finite number > 0"),
        ("0.5", r"gnmr\.gamma must be a finite number > 0"),
        (True, r"gnmr\.gamma must be a finite number > 0"),
        ({"schedule": "linear", "start": 1, "end": 0, "steps": 5}, r"gnmr\.gamma\.end must be"),
        ({"schedule": "exp", "start": 1, "end": 2, "steps": 5}, r"gnmr\.gamma\.schedule must"),
        ({"schedule": "linear", "start": 1, "end": 2}, r"gnmr\.gamma is missing required key"),
    ],
)
def test_bad_gamma_names_the_field_and_range(value, msg):
    with pytest.raises(ValueError, match=msg):
        GNMRConfig.from_dict({"gamma": value})
    with pytest.raises(ValueError, match=msg):
        GNMRConfig(gamma=value)


def test_gamma_errors_follow_the_given_path_and_typos_are_caught():
    with pytest.raises(ValueError, match=r"policy\.gamma must be a finite number > 0"):
        GNMRConfig.from_dict({"gamma": 0}, path="policy")
    with pytest.raises(ValueError, match=r"unknown key gnmr\.gama; did you mean 'gamma'"):
        GNMRConfig.from_dict({"gama": 1.0})


# ------------------------------------------------ policy v2 (docs/algorithm.md#policy)

V2 = {
    "max_active": {"schedule": "step", "start": 0, "end": 8, "clock": "lr_decay", "to": 0.5},
    "max_share": {"schedule": "linear", "start": 0.1, "end": 0.25, "steps": 100, "from": 50},
    "latch": {"lr_decay": 0.5},
    "pinned": {"units": {"last_layers": 2}, "from": {"step": 8600}},
    "alpha": {"schedule": "cosine", "start": 4.0, "end": 2.0, "clock": "lr_decay", "from": 0.2},
}


def test_new_keys_default_to_absent_and_stay_out_of_the_json_form():
    cfg = GNMRConfig()
    assert (cfg.max_share, cfg.latch, cfg.pinned) == (None, None, None)
    assert cfg.to_dict() == OLD_DEFAULT_DICT and cfg.lr_keys() == ()
    nulls = {"max_share": None, "latch": None, "pinned": None}
    assert GNMRConfig.from_dict(nulls) == cfg
    assert {"max_share", "latch", "pinned"} <= set(GNMRConfig.field_names())


def test_v2_config_round_trips_and_evaluates():
    cfg = GNMRConfig.from_dict(V2)
    assert GNMRConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["max_active"] == {
        "schedule": "step",
        "start": 0.0,
        "end": 8.0,
        "clock": "lr_decay",
        "to": 0.5,
    }
    assert cfg.to_dict()["pinned"] == V2["pinned"] and cfg.to_dict()["latch"] == V2["latch"]
    assert cfg.lr_keys() == ("max_active", "alpha", "latch")
    early, late = cfg.at(1, 0.0), cfg.at(9000, 0.6)
    assert (early.k, early.latch, early.pin, early.alpha) == (0, False, False, 4.0)
    # cosine at f = (0.6 - 0.2) / 0.8 = 1/2: halfway, 3
    assert (late.k, late.latch, late.pin) == (8, True, True)
    assert late.alpha == pytest.approx(3.0)
    assert early.share == 0.1 and cfg.at(100, 0.0).share == pytest.approx(0.175)
    with pytest.raises(ValueError, match="lr_decay clock needs the decay"):
        cfg.budget_at(1)
    assert cfg.budget_bound(1) == 8  # k_t without the learning rate: at most max(start, end)


@pytest.mark.parametrize(
    "key, value, msg",
    [
        ("max_active", 2.5, r"gnmr\.max_active must be an integer >= 0, got 2.5 \(or a budget"),
        (
            "max_active",
            {"schedule": "linear", "start": -1, "end": 2, "steps": 3},
            r"gnmr\.max_active\.start must be a finite number >= 0, got -1",
        ),
        ("max_share", 1.5, r"gnmr\.max_share must be a number >= 0 and <= 1, got 1\.5 \(the"),
        ("max_share", True, r"gnmr\.max_share must be a number >= 0 and <= 1, got True"),
        ("max_share", "0.1", r"gnmr\.max_share must be a number >= 0 and <= 1.*or null"),
        (
            "max_share",
            {"schedule": "linear", "start": 0.1, "end": 2, "steps": 3},
            r"gnmr\.max_share\.end must be a number >= 0 and <= 1, got 2",
        ),
        ("latch", {"setp": 3}, r"unknown key gnmr\.latch\.setp; did you mean 'step'"),
        ("latch", {"step": 0}, r"gnmr\.latch\.step must be an integer >= 1, got 0"),
        ("latch", {"lr_decay": 1.5}, r"gnmr\.latch\.lr_decay must be a number >= 0 and <= 1"),
        ("latch", 5, r'gnmr\.latch must be a condition, \{"step": m\}.*\(or null: no latch\)'),
        ("latch", {"step": 1, "lr_decay": 0.5}, r"gnmr\.latch must be a condition"),
        ("pinned", "all", r'gnmr\.pinned must be null or \{"units": "all", a list'),
        ("pinned", {}, r"gnmr\.pinned is missing required key\(s\) \['units'\]"),
        ("pinned", {"units": "al"}, r'gnmr\.pinned\.units must be "all", a list of unit-name'),
        ("pinned", {"units": []}, r"gnmr\.pinned\.units must be"),
        ("pinned", {"units": [3]}, r"gnmr\.pinned\.units must be"),
        (
            "pinned",
            {"units": {"last_layers": 0}},
            r"gnmr\.pinned\.units\.last_layers must be an integer >= 1, got 0",
        ),
        (
            "pinned",
            {"units": {"last_layer": 2}},
            r"unknown key gnmr\.pinned\.units\.last_layer; did you mean 'last_layers'",
        ),
        ("pinned", {"units": "all", "form": {}}, r"unknown key gnmr\.pinned\.form; did you mean"),
        (
            "pinned",
            {"units": "all", "from": {"step": 0}},
            r"gnmr\.pinned\.from\.step must be an integer >= 1",
        ),
    ],
)
def test_bad_v2_values_name_the_key_the_value_and_the_fix(key, value, msg):
    with pytest.raises(ValueError, match=msg):
        GNMRConfig.from_dict({key: value})
    with pytest.raises(ValueError, match=msg):
        GNMRConfig(**{key: value})


LR = {"schedule": "linear", "start": 1, "end": 2, "clock": "lr_decay"}


@pytest.mark.parametrize(
    "schedule, msg",
    [
        ({**LR, "steps": 3}, r'gnmr\.alpha\.steps is not allowed with "clock": "lr_decay"'),
        ({**LR, "from": 0.6, "to": 0.5}, r'gnmr\.alpha: "from" \(0\.6\) must be below "to"'),
        ({**LR, "to": 1.5}, r"gnmr\.alpha\.to must be a number >= 0 and <= 1, got 1\.5"),
        ({**LR, "from": -0.1}, r"gnmr\.alpha\.from must be a number >= 0"),
        ({**LR, "clock": "time"}, r"gnmr\.alpha\.clock must be one of \['step', 'lr_decay'\]"),
        ({**LR, "clock": "step"}, r"gnmr\.alpha is missing required key\(s\) \['steps'\]"),
        (
            {"schedule": "step", "start": 1, "end": 2, "steps": 3, "to": 0.5},
            r'gnmr\.alpha\.to is only allowed with "clock": "lr_decay"',
        ),
        (
            {"schedule": "step", "start": 1, "end": 2, "steps": 3, "from": 0},
            r"gnmr\.alpha\.from must be an integer >= 1, got 0",
        ),
        (
            {"schedule": "step", "start": 1, "end": 2, "steps": 3, "from": 1.5},
            r"gnmr\.alpha\.from must be an integer >= 1",
        ),
        ({**LR, "start": 0}, r"gnmr\.alpha\.start must be a finite number > 0"),
    ],
)
def test_malformed_clocks(schedule, msg):
    with pytest.raises(ValueError, match=msg):
        GNMRConfig.from_dict({"alpha": schedule})


def test_schedule_json_form_keeps_only_what_was_given():
    plain = {"schedule": "linear", "start": 3.0, "end": 1.5, "steps": 10}
    assert GNMRConfig.from_dict({"alpha": plain}).to_dict()["alpha"] == plain
    lr = {"schedule": "step", "start": 3.0, "end": 1.5, "clock": "lr_decay"}
    assert GNMRConfig.from_dict({"alpha": lr}).to_dict()["alpha"] == lr
    assert Schedule("linear", 1.0, 2.0, 4).to_dict() == {
        **plain,
        "start": 1.0,
        "end": 2.0,
        "steps": 4,
    }
    with pytest.raises(ValueError, match=r"policy\.latch\.step must be an integer >= 1"):
        GNMRConfig.from_dict({"latch": {"step": 0}}, path="policy")
