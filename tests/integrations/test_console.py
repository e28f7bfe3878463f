"""GNMR's console line keeps a library's manners: it never sets a level or adds a handler, the
user's logging set-up decides where it goes, and with none it still shows (on stdout, above an
open tqdm bar). Each case runs in a fresh interpreter: pytest configures logging in this one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gnmr_dist.integrations.config import LogOptions
from tests.requires import require

CASES = r"""
import io, logging, sys
from gnmr_dist.integrations.console import emit, LOGGER
case = sys.argv[1]
log = logging.getLogger(LOGGER)
if case == "silenced":
    log.setLevel(logging.WARNING)
elif case == "configured":
    logging.basicConfig(level=logging.INFO, format="%(name)s:%(message)s", stream=sys.stderr)
elif case == "bar":
    from tqdm import tqdm
    bar = tqdm(range(3), file=sys.stderr)
    next(iter(bar))
emit("gnmr step 7 | exceed 0")
if case == "bar":
    bar.close()
before = (log.level, log.handlers, log.propagate)
print("STATE", before[0], len(before[1]), before[2], file=sys.stderr)
"""


def run_case(case: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", CASES, case], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


def test_with_nothing_configured_the_line_goes_to_stdout_and_nothing_is_set():
    done = run_case("plain")
    assert done.stdout == "gnmr step 7 | exceed 0\n"
    assert "STATE 0 0 True" in done.stderr  # no level, no handler, propagation untouched


def test_a_users_level_silences_it_and_stays_as_set():
    done = run_case("silenced")
    assert done.stdout == "" and "STATE 30 0 True" in done.stderr


def test_a_configured_program_gets_it_through_its_handlers():
    done = run_case("configured")
    assert done.stdout == "" and "gnmr_dist.console:gnmr step 7 | exceed 0" in done.stderr


def test_an_open_tqdm_bar_is_written_above():
    done = run_case("bar")
    assert done.stdout == "gnmr step 7 | exceed 0\n"


@pytest.mark.parametrize(
    ("given", "console"),
    [({}, 25), ({"console": 1}, 1), ({"console": False}, 0), ({"console": 0}, 0)],
)
def test_log_console_is_its_own_switch(given, console):
    options = LogOptions.from_dict({**given, "monitor": False}, "gnmr.log")
    assert options.console == console and not options.monitor


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, r"gnmr\.log\.console must be a number of steps \(e\.g\. 25\) or false, got true"),
        (-2, r"gnmr\.log\.console must be an integer >= 1, got -2"),
        ("often", r"gnmr\.log\.console must be an integer >= 1, got 'often'"),
    ],
)
def test_bad_console_values_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        LogOptions.from_dict({"console": value}, "gnmr.log")


def test_the_callback_warns_once_when_an_engine_missed_it(caplog):
    """The config enables GNMR but no engine got it after the callback was made: one warning;
    training ends and the callback disables what it enabled."""
    require("deepspeed")
    require("transformers")
    import types

    from gnmr_dist import GNMRCallback
    from gnmr_dist.integrations.deepspeed import engine as gds

    args = types.SimpleNamespace(deepspeed={"gnmr": {"max_active": 2}})
    callback = GNMRCallback()
    assert gds.is_enabled()  # enabled by the callback itself
    with caplog.at_level("WARNING", logger="gnmr_dist.integrations.deepspeed.trainer"):
        callback.on_train_begin(args, None, None)
        callback.on_train_begin(args, None, None)
    said = [r.getMessage() for r in caplog.records if "has no GNMR" in r.getMessage()]
    assert len(said) == 1 and "Make the callback before the Trainer" in said[0]
    off = types.SimpleNamespace(deepspeed={"gnmr": {"enabled": False}})
    caplog.clear()
    GNMRCallback().on_train_begin(off, None, None)
    assert not caplog.records
    callback.on_train_end(args, None, None)
    assert not gds.is_enabled()
