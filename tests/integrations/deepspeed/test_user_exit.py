"""A user's own DeepSpeed script and a user's Trainer script with ``GNMRCallback`` end without
gloo's native abort at exit, with nothing done at their end (``user_scripts/``): real
DeepSpeed, transformers and accelerate, 2 ranks under torchrun, each run rc 0 with no
"terminate called without an active exception" and GNMR's 6 decisions made on both ranks.
``async``: the DeepSpeed script all-reduces its metrics as its last act and leaves without
waiting; before GNMR's exit hook, 6 of 10 such runs aborted (the plain end: 0 of 20, the
Trainer's: 1 of 20)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_exit_hook import user_run
from tests.requires import require

require("deepspeed")
require("accelerate")

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "user_scripts"


@pytest.mark.parametrize(
    ("script", "tail"), [("ds_user.py", ()), ("trainer_user.py", ()), ("ds_user.py", ("async",))]
)
def test_user_script_exits_cleanly(script, tail, tmp_path):
    text = user_run(SCRIPTS / script, str(tmp_path), *tail)
    assert text.count(": 6 GNMR decisions") == 2, text[-3000:]
    assert (tmp_path / "trace.jsonl").is_file()
