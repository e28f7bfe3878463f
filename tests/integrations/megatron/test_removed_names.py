"""Issue 41, item 8: the names ``megatron_patches`` exported once and no longer does (read from
``git log -- megatron_patches``: up to issue 32 the package re-exported its submodules, the
version table, and ``loop.attach()`` read the ``--gnmr-*`` flags from ``sys.argv``) fail with an
error that names what replaced them, never a bare ``AttributeError`` /
``ModuleNotFoundError``; so does ``attach()`` called the old way, without a block.

The old forms run in a fresh process, where ``megatron_patches`` is imported for the first time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

NEW_CALL = "extra_args_provider = attach_from_argv()"
SECTION = 'docs/megatron.md, "Megatron-LM\'s training loop"'

OLD_FORMS = {
    "attribute": "import megatron_patches\nmegatron_patches.loop.attach()",
    "import": "import megatron_patches.loop\nmegatron_patches.loop.attach()",
    "from-import": "from megatron_patches import loop\nloop.attach()",
    "from-loop-import": "from megatron_patches.loop import attach\nattach()",
    "no block": "import megatron_patches\nmegatron_patches.attach()",
    "a provider": "import megatron_patches\nmegatron_patches.attach(lambda parser: parser)",
    "new, no block": "import megatron_patches\nmegatron_patches.enable_loop()",
}
"""How scripts called the old command-line attachment, and the new call mistaken for it."""

EXPECTED = {
    "attribute": "megatron_patches.RemovedNameError",
    "import": "ImportError",
    "from-import": "ImportError",
    "from-loop-import": "ImportError",
    "no block": "TypeError",
    "a provider": "TypeError",
    "new, no block": "TypeError",
}


_FORMS = """
import json, sys
out = {}
for form, code in json.loads(sys.argv[1]).items():
    try:
        exec(code, {})
        out[form] = ["no error", ""]
    except BaseException as err:
        kind = type(err)
        out[form] = [f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins."), str(err)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors() -> dict[str, list[str]]:
    """``form: [qualified exception type, message]`` of each old form, run in one fresh process
    (``megatron_patches`` imported there for the first time)."""
    done = subprocess.run(
        [sys.executable, "-c", _FORMS, json.dumps(OLD_FORMS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("form", sorted(OLD_FORMS))
def test_the_old_megatron_lm_call_names_attach_from_argv_and_the_doc_section(
    form: str, errors: dict[str, list[str]]
) -> None:
    kind, message = errors[form]
    assert kind == EXPECTED[form], (kind, message)
    assert "from gnmr_dist.train.megatron_flags import attach_from_argv" in message, message
    assert NEW_CALL in message and SECTION in message, message


def test_every_removed_name_says_what_replaced_it() -> None:
    """Each name of the pre-issue-32 ``__all__`` that is not public now raises
    ``RemovedNameError`` (an ``AttributeError``: ``hasattr`` stays False) naming its home."""
    import megatron_patches

    old_all = {
        "SERIES", "SUPPORTED_MEGATRON_VERSIONS", "MegatronGNMR", "SeriesInfo", "apply",
        "attribution", "cpu", "cpu_compat", "cpu_transformer_config", "current",
        "disable_cpu_compat", "enable_cpu_compat", "gnmr", "is_cpu_compat_enabled", "loop",
        "megatron_series", "operators", "remove", "series_info", "session", "te", "versions",
        "cpu_training",
    }  # fmt: skip
    removed = old_all - set(megatron_patches.__all__) - set(megatron_patches.DEPRECATED)
    removed -= {"apply", "remove"}  # deprecated aliases of enable / disable (issue 45)
    assert removed == set(megatron_patches.REMOVED)
    homes = {
        "cpu": "enable_cpu_compat",
        "cpu_training": "enable_cpu_compat(training=True)",
        "gnmr": "megatron_patches.enable",
        "SERIES": "gnmr_dist.integrations.megatron.versions",
        "SUPPORTED_MEGATRON_VERSIONS": "gnmr_dist.testing.megatron_cpu",
        "te": "gnmr_dist.integrations.megatron.te",
        "loop": "attach_from_argv",
    }
    for name in sorted(removed):
        assert not hasattr(megatron_patches, name)
        with pytest.raises(megatron_patches.RemovedNameError) as caught:
            getattr(megatron_patches, name)
        assert str(caught.value).startswith(f"megatron_patches.{name} ")
        assert "docs/megatron.md" in str(caught.value)
        assert homes.get(name, "gnmr_dist.integrations.megatron") in str(caught.value)
    for name in megatron_patches.DEPRECATED:  # issue 45: aliases for one release, with a warning
        assert name not in megatron_patches.__all__
        with pytest.warns(DeprecationWarning, match=f"gnmr_dist.testing.megatron_cpu.{name}"):
            alias = getattr(megatron_patches, name)
        from gnmr_dist.testing import megatron_cpu

        assert alias is getattr(megatron_cpu, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'") as other:
        megatron_patches.nothing  # noqa: B018
    assert not isinstance(other.value, megatron_patches.RemovedNameError)
