"""Issue 33, item 1: an enabled ``"gnmr"`` block that reaches plain ``deepspeed.initialize`` (a
script without ``gnmr_dist.deepspeed``, a Trainer without ``GNMRCallback``) trained plain
DeepSpeed without a word. Now one warning per process names the fix; GNMR's own routes say
nothing (:mod:`gnmr_dist.integrations.ds_watch`). Real DeepSpeed, transformers and accelerate."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.requires import require

require("deepspeed")
require("accelerate")

from tests import multiproc
from tests.integrations.deepspeed import common as dsc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
BLOCK = {"backend": "act_quant", "max_active": 2}
UNREAD = 'gnmr: this DeepSpeed config has an enabled "gnmr" block, but its engine was built by '


def _said(records: list[str]) -> list[str]:
    return [m for m in records if m.startswith(UNREAD)]


class _Records(logging.Handler):
    """The messages ``gnmr_dist`` logs at WARNING and above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("gnmr_dist").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


SNIPPET = """
import sys
{first}
{second}
import deepspeed, gnmr_dist.integrations.ds_watch as w
finders = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == w.__name__]
init = deepspeed.DeepSpeedEngine.__init__
own = init.__wrapped__
print(init.__gnmr_watch__, own.__module__, own.__qualname__, finders)
"""


@pytest.mark.parametrize("first", ["gnmr_dist", "deepspeed"])
def test_deepspeed_is_watched_whichever_is_imported_first(first):
    """``import gnmr_dist`` does not import DeepSpeed; DeepSpeed imported after it is wrapped
    as its module finishes (the finder then leaves ``sys.meta_path``), and DeepSpeed imported
    before it is wrapped at once; either way the wrapper is the engine class's own
    ``__init__``'s."""
    second = "deepspeed" if first == "gnmr_dist" else "gnmr_dist"
    check = "assert 'deepspeed' not in sys.modules" if first == "gnmr_dist" else ""
    code = SNIPPET.format(first=f"import {first}; {check}", second=f"import {second}")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    assert last == "True deepspeed.runtime.engine DeepSpeedEngine.__init__ []"


def _plain_worker(rank: int, world: int, out_dir: str) -> dict[str, list[str]]:
    """Engines built by plain DeepSpeed, and by GNMR's own route, with and without a block."""
    import deepspeed

    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    records = _Records()
    said: dict[str, list[str]] = {}

    def build(name: str, initialize, config) -> None:
        start = len(records.messages)
        initialize(model=dsc.llama(), config=config)
        said[name] = _said(records.messages[start:])

    build("ours", gds.initialize, dsc.ds_config(0, gnmr=BLOCK))
    build("disabled", deepspeed.initialize, dsc.ds_config(0, gnmr={**BLOCK, "enabled": False}))
    build("none", deepspeed.initialize, dsc.ds_config(0))
    with gds.enable():  # enable() replaces the watch: the block is read, nothing to say
        build("enabled", deepspeed.initialize, dsc.ds_config(0, gnmr=BLOCK))
    path = Path(out_dir, "ds.json")
    path.write_text(json.dumps(dsc.ds_config(0, gnmr=BLOCK)))
    build("file", deepspeed.initialize, str(path))  # a config file's block, as a dict's
    build("again", deepspeed.initialize, dsc.ds_config(0, gnmr=BLOCK))  # once per process
    return said


def test_plain_deepspeed_with_an_enabled_block_warns_once_naming_the_fix(tmp_path):
    (said,) = multiproc.run(_plain_worker, 1, str(tmp_path))
    quiet = ("ours", "disabled", "none", "enabled", "again")
    assert [said[name] for name in quiet] == [[]] * len(quiet)
    (line,) = said["file"]
    assert line.endswith(
        "so the block is ignored and GNMR is off. Call gnmr_dist.deepspeed.initialize "
        "(the same arguments) instead"
    )


def _trainer_worker(rank: int, world: int, out_dir: str) -> dict[str, object]:
    """A Trainer with ``GNMRCallback`` (GNMR runs, nothing to say), then one without it."""
    from gnmr_dist import GNMRCallback
    from tests.integrations.deepspeed.test_trainer import one_step_trainer

    dsc.no_shm_build()
    records = _Records()
    with_callback = one_step_trainer(out_dir, world, dsc.ds_config(0, gnmr=BLOCK), [GNMRCallback()])
    quiet = _said(records.messages)
    without = one_step_trainer(out_dir, world, dsc.ds_config(0, gnmr=BLOCK), [])
    return {
        "gnmr": [hasattr(with_callback, "gnmr"), hasattr(without, "gnmr")],
        "with_callback": quiet,
        "without": _said(records.messages),
        "all": [m for m in records.messages if "gnmr" in m],
    }


def test_a_trainer_with_a_block_and_no_callback_warns_once_naming_the_callback(tmp_path):
    (got,) = multiproc.run(_trainer_worker, 1, str(tmp_path))
    assert got["gnmr"] == [True, False]
    assert got["with_callback"] == []
    (line,) = got["without"]
    assert "Give the Trainer callbacks=[GNMRCallback()] (from gnmr_dist import" in line
    assert got["all"] == got["without"]  # the one GNMR warning of both runs
