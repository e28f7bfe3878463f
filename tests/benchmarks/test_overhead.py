"""benchmarks/overhead/collectives.py: the collective recorder, and GNMR's one extra all-reduce
under ZeRO-1."""

from __future__ import annotations

import os
import types
from collections import Counter
from unittest import mock

import pytest
import torch

from benchmarks.harness.common import gloo_world
from benchmarks.overhead import collectives as oh
from tests.requires import require


def test_payload_bytes_of_tensors_lists_and_objects():
    assert oh._payload(torch.zeros(5, dtype=torch.float64)) == ("float64", 5, 40)
    assert oh._payload([torch.zeros(3), torch.zeros(2)]) == ("float32", 5, 20)
    assert oh._payload(torch.zeros((), dtype=torch.bfloat16)) == ("bfloat16", 1, 2)
    assert oh._payload({"any": "object"}) == ("object", -1, -1)
    assert oh._payload(None) == ("-", 0, -1)


def test_extra_calls_is_a_multiset_difference():
    c = oh.Call
    off = [c("all_reduce", "float32", 10, 40), c("all_gather_into_tensor", "float32", 5, 20)]
    on = [off[0], c("all_reduce", "float64", 29, 232), off[1]]
    assert oh.extra_calls(on, off) == {"extra": oh.expected_extra(28), "missing": Counter()}
    # an extra call of the same kind as a plain one is still counted once more
    twice = [*on, off[0]]
    assert oh.extra_calls(twice, off)["extra"] == Counter(
        {("all_reduce", 232): 1, ("all_reduce", 40): 1}
    )
    assert oh.extra_calls(off, on)["missing"] == oh.expected_extra(28)


def test_gloo_calls_reads_shapes_and_dtypes_of_gloo_events():
    def event(name, shapes, dtypes, start):
        return types.SimpleNamespace(
            name=name,
            input_shapes=shapes,
            input_dtypes=dtypes,
            time_range=types.SimpleNamespace(start=start),
        )

    prof = types.SimpleNamespace(
        events=lambda: [
            event("gloo:all_reduce", [[29]], ["double"], 2),
            event("c10d::allreduce_", [[], []], ["", ""], 1),
            event("gloo:all_reduce", [[]], ["float"], 3),  # a 0-dim tensor: one element
            event("gloo:all_gather", [[4], [8]], ["float", "float"], 0),
        ]
    )
    calls = oh.gloo_calls(prof)
    assert [(x.op, x.numel, x.bytes) for x in calls] == [
        ("gloo:all_gather", 12, 48),
        ("gloo:all_reduce", 29, 232),
        ("gloo:all_reduce", 1, 4),
    ]


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process (the benchmarks' own), torn down afterwards with
    the environment it set."""
    with mock.patch.dict(os.environ), gloo_world():
        yield


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_recorder_records_each_collective_once_with_its_payload(one_rank_group):
    import torch.distributed as dist
    from torch.profiler import profile

    real = dist.all_reduce
    rec = oh.CommRecorder().install()
    assert dist.all_reduce is not real
    try:
        with rec.window() as calls, profile(record_shapes=True) as prof:
            dist.all_reduce(torch.ones(7, dtype=torch.float64))
            dist.all_reduce(torch.ones(3), async_op=True).wait()
            dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
            dist.all_gather_object([None], {"rank": 0})  # runs all_gather inside
        dist.all_reduce(torch.ones(1))  # outside the window: not recorded
    finally:
        rec.uninstall()
    assert dist.all_reduce is real
    c = oh.Call
    assert calls == [
        c("all_reduce", "float64", 7, 56),
        c("all_reduce", "float32", 3, 12),
        c("all_gather_into_tensor", "float32", 2, 8),
        c("all_gather_object", "object", -1, -1),
    ]
    # the profiler sees the same tensors reach gloo (all_gather_object: two all_gathers)
    gloo = oh.gloo_calls(prof)
    assert [(g.op, g.bytes) for g in gloo[:3]] == [
        ("gloo:all_reduce", 56),
        ("gloo:all_reduce", 12),
        ("gloo:all_gather", 8),
    ]
    assert [g.op for g in gloo[3:]] == ["gloo:all_gather"] * 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gnmr_adds_exactly_one_all_reduce_of_u_plus_1_float64_under_zero1():
    require("deepspeed")
    spec = oh.CollectiveSpec(
        model="stack", layers=2, hidden=32, seq_len=16, batch=2, steps=2, max_active=2
    )
    units = oh.independent_units(spec)
    assert units == 14  # 7 projections x 2 layers, counted without the unit registry
    res = oh.part_c(spec)
    assert res["units_registry"] == units and res["expected_extra_bytes"] == 8 * (units + 1)
    assert len(res["rows"]) == 2 * spec.steps
    for row in res["rows"]:
        # the wrapper and the profiler's gloo events agree, and differ from the plain step by
        # exactly one all_reduce of 8 (U + 1) bytes
        assert row["extra"] == row["extra_gloo"] == [("all_reduce", 8 * (units + 1))], row
        assert row["on_calls"] == row["off_calls"] + 1 == row["on_gloo_calls"]
        assert row["on_bytes"] - row["off_bytes"] == 8 * (units + 1)
        assert row["on_gloo_bytes"] - row["off_gloo_bytes"] == 8 * (units + 1)
        assert row["off_bytes"] == row["off_gloo_bytes"] > 0
    assert res["ok"]
