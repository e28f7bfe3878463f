"""One verb pair for every integration (issue 45): ``enable`` / ``disable``, each ``enable`` also
a context manager, and the verbs of earlier releases as deprecated aliases that warn."""

from __future__ import annotations

import pytest

from gnmr_dist.integrations.switch import Enabled, deprecated


def test_enabled_disables_on_exit_only_what_it_enabled():
    calls: list[str] = []
    with Enabled(lambda: calls.append("off"), owned=True) as on:
        assert isinstance(on, Enabled) and calls == []
    assert calls == ["off"]
    with Enabled(lambda: calls.append("off"), owned=False):
        pass
    assert calls == ["off"]  # on before the with-block: left on


def test_a_deprecated_alias_warns_naming_its_successor_then_calls_it():
    alias = deprecated("old_name()", "new_name()", lambda x, *, y: (x, y))
    with pytest.warns(DeprecationWarning, match=r"old_name\(\) is deprecated: call new_name\(\)"):
        assert alias(1, y=2) == (1, 2)


def test_deepspeed_enable_is_a_context_manager_and_enabled_its_alias():
    pytest.importorskip("deepspeed")
    import gnmr_dist.deepspeed as gds

    assert not gds.is_enabled()
    with gds.enable():
        assert gds.is_enabled()
        with gds.enable():  # on already: the inner block leaves it on
            pass
        assert gds.is_enabled()
    assert not gds.is_enabled()
    warns = pytest.warns(DeprecationWarning, match=r"gnmr_dist\.deepspeed\.enable\(\)")
    with warns, gds.enabled():
        assert gds.is_enabled()
    assert not gds.is_enabled()


@pytest.mark.parametrize(
    "old, new",
    [
        ("apply", "enable"),
        ("remove", "disable"),
        ("attach", "enable_loop"),
        ("detach", "disable_loop"),
    ],
)
def test_megatron_patches_old_verbs_are_warning_aliases_of_the_new(old, new):
    import megatron_patches

    assert old not in megatron_patches.__all__ and new in megatron_patches.__all__
    alias = getattr(megatron_patches, old)
    assert alias.__wrapped__ is getattr(megatron_patches, new)
    if old in ("remove", "detach"):  # a no-op while nothing is enabled: safe to call here
        with pytest.warns(DeprecationWarning, match=f"megatron_patches.{new}"):
            alias()
