"""Every wrong type in the ``"gnmr"`` block and the backends' option blocks is refused by name.

A property test (hypothesis): one key of a valid block, at any depth, gets a JSON value of a
type that key never accepts; the entry point must raise ``ValueError`` or ``TypeError`` whose
message starts with the key's full path (``gnmr.log.every``, ``gnmr.low_cost.format``). Nothing
may be accepted silently, and no message may come from Python's own type machinery
(``unhashable type: 'list'``). Four entry points, at least 1,000 examples each:
``GNMRBlock.from_dict``, ``get_backend``, ``gnmr_dist.deepspeed.initialize`` and
``megatron_patches.enable``.

The key table below is the block's documented schema; ``test_the_table_covers_every_key``
checks it against the parsers' own key lists, so a new key cannot escape the fuzz.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gnmr_dist.backends import BACKENDS, get_backend
from gnmr_dist.core import GNMRConfig
from gnmr_dist.integrations.config import AttributionGuard, GNMRBlock, LogOptions, ProbeOptions
from tests.requires import require

EXAMPLES = 1000

# kinds: what a key accepts (its type; values of the right type may still be out of range);
# "budget": an integer or a budget schedule (max_active); a condition (latch, pinned.from) and
# pinned are objects, whose own keys tests/core fuzzes
BLOCK_KEYS: dict[str, str] = {
    "enabled": "bool",
    "backend": "str|None",
    "units": "str",
    "include": "list[str]",
    "exclude": "list[str]",
    "max_active": "budget",
    "max_share": "threshold|None",
    "latch": "dict|None",
    "pinned": "dict|None",
    "gemms": "list[str]",
    "lock_steps": "int",
    "window": "int",
    "warmup_steps": "int",
    "alpha": "threshold",
    "beta": "threshold",
    "gamma": "threshold|None",
    "low_cost": "dict|None",
    "recovery": "dict|None",
    "log": "dict|None",
    "log.trace": "str|None",
    "log.monitor": "bool",
    "log.every": "int",
    "log.console": "int|bool",
    "check_consistency": "bool",
    "on_missing_state": "str",
    "on_corrupt_state": "str",
    "attribution": "dict|None",
    "attribution.max_rest_share": "number",
    "attribution.action": "str",
    "probe": "dict|None",
    "probe.every": "int",
    "probe.k": "int",
    "error_every": "int",
}

OPTION_CLASSES = {
    name: (cls.LowCost, cls.Recovery)
    for name, cls in BACKENDS.items()
    if cls.__module__.startswith("gnmr_dist.")
}
"""Every built-in backend's option dataclasses, from the registry (a new backend is fuzzed
without a line here; an own backend another test module registered first is not ours)."""


def _kind_of(annotation: Any) -> str:
    """The kind of an option dataclass field from its annotation (``int | None`` -> ...)."""
    names = {"int": "int", "str": "str", "float": "number", "bool": "bool"}
    args = typing.get_args(annotation) or (annotation,)
    kinds = [names[a.__name__] for a in args if a is not type(None)]
    return "|".join(kinds) + ("|None" if type(None) in args else "")


def option_keys(cls: type) -> dict[str, str]:
    hints = typing.get_type_hints(cls)
    return {f.name: _kind_of(hints[f.name]) for f in dataclasses.fields(cls)}


def fits(kind: str, value: Any) -> bool:
    """Whether ``value`` has a type ``kind`` admits (the right type, not necessarily valid)."""
    for part in kind.split("|"):
        if part == "None" and value is None:
            return True
        if part == "bool" and isinstance(value, bool):
            return True
        if part == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if part in ("number", "threshold") and numeric:
            return True
        if part in ("threshold", "budget") and isinstance(value, dict):
            return True  # a schedule's own keys are fuzzed by tests/core (schedules)
        if part == "budget" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part == "list[str]" and isinstance(value, list):
            return all(isinstance(v, str) for v in value)
        if part == "dict" and isinstance(value, dict):
            return True
    return False


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["act_quant", "layer", "error", "fresh", "e4m3", "row", "bf16", "max"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
"""Any JSON value (numbers, strings, null, lists, objects; NaN and infinities too)."""


def with_value(base: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with ``dotted`` (``"log.every"``) set to ``value``."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    *parents, leaf = dotted.split(".")
    node = out
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


BASE_BLOCK = {
    "backend": "act_quant",
    "gamma": 0.5,
    "log": {},
    "attribution": {},
    "probe": {"every": 5},
}
"""A valid block in which every nested block is present (so a nested key can be set)."""


def assert_named(err: BaseException, path: str) -> None:
    msg = str(err)
    assert isinstance(err, ValueError | TypeError), repr(err)
    assert msg.startswith(path) or msg.startswith(f"unknown key {path}"), (path, msg)
    assert "unhashable" not in msg and "object is not iterable" not in msg, msg


def block_case(key: str, value: Any) -> dict[str, Any]:
    assume(not fits(BLOCK_KEYS[key], value))
    base = dict(BASE_BLOCK)
    if key == "backend":
        base.pop("probe")  # a probe needs a backend: the fuzzed key would not be the first error
    return with_value(base, key, value)


# -------------------------------------------------------------------------------- the table


def test_the_table_covers_every_key():
    nested = {"log": LogOptions, "attribution": AttributionGuard, "probe": ProbeOptions}
    keys = set(GNMRBlock.keys()) | {
        f"{n}.{f.name}" for n, c in nested.items() for f in dataclasses.fields(c)
    }
    assert keys == set(BLOCK_KEYS)
    assert set(GNMRConfig.field_names()) <= set(BLOCK_KEYS)
    built_in = {n for n, c in BACKENDS.items() if c.__module__.startswith("gnmr_dist.")}
    assert set(OPTION_CLASSES) == built_in  # own backends other tests register are not ours


def test_the_base_block_and_options_are_valid():
    block = GNMRBlock.from_dict(BASE_BLOCK)
    assert block.backend == "act_quant" and block.probe is not None and block.probe.every == 5
    for name in ("act_quant", "fp8_emulated", "int8"):
        assert get_backend(name).name == name


# ------------------------------------------------------------------------ the entry points

_FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)


@_FUZZ
@given(key=st.sampled_from(sorted(BLOCK_KEYS)), value=JSON)
def test_block_from_dict_names_every_wrong_type(key, value):
    with pytest.raises((ValueError, TypeError)) as info:
        GNMRBlock.from_dict(block_case(key, value))
    assert_named(info.value, f"gnmr.{key}")


def _option_case(data: st.DataObject) -> tuple[str, str, str, Any]:
    backend = data.draw(st.sampled_from(sorted(OPTION_CLASSES)))
    path = data.draw(st.sampled_from(["low_cost", "recovery"]))
    keys = option_keys(OPTION_CLASSES[backend][path == "recovery"])
    key = data.draw(st.sampled_from(sorted(keys)))
    value = data.draw(JSON)
    assume(not fits(keys[key], value))
    return backend, path, key, value


@_FUZZ
@given(data=st.data())
def test_get_backend_names_every_wrong_type(data):
    backend, path, key, value = _option_case(data)
    with pytest.raises((ValueError, TypeError)) as info:
        get_backend(backend, **{path: {key: value}})
    assert_named(info.value, f"gnmr.{path}.{key}")


def test_a_non_mapping_option_block_is_named():
    for given_ in ([1, 2], "e4m3", 3):
        with pytest.raises(ValueError) as info:
            get_backend("fp8_emulated", low_cost=given_)
        assert_named(info.value, "gnmr.low_cost")


def _ds_refuses(gnmr: dict[str, Any]) -> BaseException:
    import gnmr_dist.deepspeed as gds

    config = {"train_micro_batch_size_per_gpu": 1, "gnmr": gnmr}
    with pytest.raises((ValueError, TypeError)) as info:
        gds.initialize(model=torch.nn.Linear(4, 4), config=config)
    return info.value


@_FUZZ
@given(data=st.data())
def test_deepspeed_initialize_names_every_wrong_type(data):
    """Block keys and (through the block) backend option keys: refused before DeepSpeed or a
    process group starts."""
    require("deepspeed")
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(BLOCK_KEYS)))
        err = _ds_refuses(block_case(key, data.draw(JSON)))
        assert_named(err, f"gnmr.{key}")
    else:
        backend, path, key, value = _option_case(data)
        err = _ds_refuses({"backend": backend, path: {key: value}})
        assert_named(err, f"gnmr.{path}.{key}")


def test_nan_and_infinity_are_not_numbers_here():
    for key in ("alpha", "beta", "gamma", "attribution.max_rest_share"):
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError) as info:
                GNMRBlock.from_dict(with_value(BASE_BLOCK, key, bad))
            assert_named(info.value, f"gnmr.{key}")


@_FUZZ
@given(data=st.data())
def test_megatron_patches_apply_names_every_wrong_type(data):
    """The same through ``megatron_patches.enable`` (its block reader and backend build run
    before anything is patched, so a plain module stands in for the model)."""
    require("megatron.core")
    import megatron_patches

    def refused(block: dict[str, Any]) -> BaseException:
        with pytest.raises((ValueError, TypeError)) as info:
            megatron_patches.enable(torch.nn.Linear(4, 4), block)
        return info.value

    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(BLOCK_KEYS)))
        assume(not key.startswith("probe"))  # the probe is refused under megatron as a whole
        block = block_case(key, data.draw(JSON))
        block.pop("probe", None)
        assert_named(refused(block), f"gnmr.{key}")
    else:
        backend, path, key, value = _option_case(data)
        assert_named(refused({"backend": backend, path: {key: value}}), f"gnmr.{path}.{key}")


@pytest.mark.parametrize(
    "block, path",
    [
        ({"backend": ["act_quant"]}, "gnmr.backend"),
        ({"include": None}, "gnmr.include"),
        ({"include": {"*q_proj": 1}}, "gnmr.include"),  # once taken as its keys
        ({"backend": "te_fp8", "low_cost": {"recipe": []}}, "gnmr.low_cost.recipe"),
        ({"backend": "act_quant", "low_cost": {"bits": 4.0}}, "gnmr.low_cost.bits"),
        ({"backend": "fp8_emulated", "recovery": ["bf16"]}, "gnmr.recovery"),
    ],
)
def test_the_cases_found_by_hand_are_named(block, path):
    """The issue's examples (and two the fuzz found), through the block and the backend."""
    with pytest.raises(ValueError) as info:
        parsed = GNMRBlock.from_dict(block)
        get_backend(parsed.backend, low_cost=parsed.low_cost, recovery=parsed.recovery)
    assert_named(info.value, path)
