"""Issue 41, item 5: a module Megatron-LM's loop imports that does not import here is refused at
start, naming its package and the pip command, by ``gnmr-megatron-pretrain`` and by
``gnmr-launch check``'s ``check_args``, before megatron parses or builds anything.

Each case runs in a process of its own where the module is made unimportable
(``sys.modules[name] = None``: ``import name`` then raises ``ImportError``, as in a venv without
it). Before the fix a missing ``yaml`` was blamed on Python 3.11 and a missing ``psutil``
passed every check and failed the first checkpoint save.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.megatron.settings import training_env, version_sys_path

ROOT = Path(__file__).resolve().parents[3]

ARGS = shlex.split("""
--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --train-iters 4
--lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 256 --mock-data --eval-iters 0
""")

_CASE = """
import json, sys
case = json.loads(sys.argv[1])
for name in case["block"]:
    sys.modules[name] = None
from gnmr_dist.integrations.megatron import loop
from gnmr_dist.train import megatron_lm
out = {}
for key, call in (
    ("main", lambda argv: megatron_lm.main(argv)),
    ("check", lambda argv: megatron_lm.check_args(argv, 2)),
    ("require", lambda argv: loop.require_training(argv)),
):
    if key in case:
        try:
            out[key] = call(case[key])
        except ValueError as err:
            out[key] = str(err)
print("RESULT " + json.dumps(out))
"""


def _run(block: list[str], env: dict[str, str] | None = None, **calls: list[str]) -> Any:
    """Run the calls in a fresh process with ``block`` unimportable; their results and the
    process's output."""
    case = json.dumps({"block": block, **calls})
    done = subprocess.run(
        [sys.executable, "-c", _CASE, case],
        cwd=ROOT,
        env=env or training_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT ")), done.stdout + done.stderr


def _refused(output: str, package: str) -> None:
    assert f"Install them: pip install {package}" in output, output[-3000:]
    assert "Traceback" not in output and "Python 3.1" not in output, output[-3000:]
    assert "-- arguments --" not in output  # refused before megatron parsed anything


@pytest.mark.slow
def test_a_missing_yaml_names_pyyaml_and_its_pip_command_not_the_python_version() -> None:
    result, output = _run(["yaml"], main=ARGS, check=ARGS)
    assert result["main"] == 2
    _refused(output, "pyyaml")
    assert "pyyaml (module 'yaml'" in output
    assert "megatron.training.initialize imports it" in result["check"]
    assert "pip install pyyaml" in result["check"] and "Python 3." not in result["check"]


@pytest.mark.slow
def test_a_missing_psutil_is_refused_at_start_not_at_the_first_checkpoint_save(
    tmp_path: Path,
) -> None:
    argv = [*ARGS, "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    result, output = _run(["psutil"], main=argv, check=argv)
    assert result["main"] == 2
    _refused(output, "psutil")
    assert "without it the first --save fails" in output
    assert "pip install psutil" in result["check"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_flags_module_is_needed_only_with_that_flag() -> None:
    """``--tensorboard-dir`` needs tensorboard (megatron would only warn and write no log), a
    SentencePiece tokenizer needs sentencepiece; the same run without the flag needs neither."""
    with_flags = [*ARGS, "--tensorboard-dir", "tb", "--tokenizer-type=Llama2Tokenizer"]
    result, output = _run(
        ["tensorboard", "sentencepiece"], main=with_flags, require=ARGS, check=with_flags
    )
    assert result["main"] == 2 and result["require"] is None
    _refused(output, "tensorboard sentencepiece")
    assert "for --tensorboard-dir tb: " in output
    assert "for --tokenizer-type Llama2Tokenizer: " in output
    assert "pip install tensorboard sentencepiece" in result["check"]


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="0.19's megatron.training imports there")
def test_megatron_019_on_python_311_is_blamed_on_python_not_on_a_package() -> None:
    """The Python-version message stays for what is one: 0.19 imports ``typing.override``
    (a guard on the rewritten message: it passed before the fix too)."""
    env = {
        **training_env(),
        "PYTHONPATH": os.pathsep.join([*version_sys_path("0.19.2"), str(ROOT)]),
    }
    result, _ = _run([], env=env, check=ARGS)
    message = result["check"]
    assert "megatron-core 0.19 does not import on Python 3.11" in message, message
    assert "override" in message and "pip install" not in message
