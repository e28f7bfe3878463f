"""``gamma`` with a backend that reports no error sums is refused where the block is read
(issue 41, item 3): by ``GNMRBlock.from_dict``, so by ``gnmr-launch check``, the launcher's
preflight, Megatron-LM's argument check and ``attach_from_argv()``, before any process or model
exists; the runtime keeps its guard for a backend that declares ``reports_errors`` but returns
``None``. No message cites the design card's "section 2.1"."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from gnmr_dist.backends import BACKENDS, register_backend
from gnmr_dist.core import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.train import launch
from tests.backends.external import RoundedBackend
from tests.distributed.toy import Toy

ROOT = Path(__file__).resolve().parents[2]
FIX = re.compile(r"set gnmr\.backend to one that reports them \(([^)]*)\) or drop gnmr\.gamma$")
"""The end of the refusal: the registered backends whose class reports error sums."""


class ClaimsErrors(RoundedBackend):
    """Declares ``reports_errors`` but its ``error_sums`` returns ``None`` (a bug of its own)."""

    reports_errors = True

    def error_sums(self, device: torch.device) -> torch.Tensor | None:
        return None


@pytest.fixture(autouse=True)
def claims_errors():
    """``test_claims_errors`` registered for this module's tests only: the backend contract
    tests iterate every registered backend, and this one is a deliberate bug."""
    register_backend("test_claims_errors")(ClaimsErrors)
    yield
    del BACKENDS["test_claims_errors"]


@pytest.mark.parametrize(
    "backend, said",
    [
        (None, "gnmr.backend=null (observe only) runs no low-cost path to measure"),
        (
            "test_rounded",  # an own backend (tests/backends/external.py) that reports none
            "gnmr.backend='test_rounded' reports none (its class sets reports_errors = False)",
        ),
    ],
)
def test_gamma_without_error_sums_is_refused_when_the_block_is_read(backend, said):
    assert not BACKENDS["test_rounded"].reports_errors
    with pytest.raises(ValueError) as err:
        GNMRBlock.from_dict({"backend": backend, "gamma": 0.5})
    message = str(err.value)
    assert message.startswith("gnmr.gamma scores the damage term e = B(u) / G")
    assert "docs/algorithm.md#damage-term" in message and said in message
    listed = FIX.search(message).group(1).split(", ")
    assert {"act_quant", "fp8_emulated", "int8", "te_fp8", "test_claims_errors"} <= set(listed)
    assert "test_rounded" not in listed and listed == sorted(listed)
    for reporting in ("act_quant", "fp8_emulated", "int8", "te_fp8"):  # te_fp8: the shadow route
        assert GNMRBlock.from_dict({"backend": reporting, "gamma": 0.5}).policy.gamma == 0.5


def test_the_runtime_guards_a_backend_that_claims_error_sums_but_returns_none():
    block = GNMRBlock.from_dict({"backend": "test_claims_errors", "gamma": 0.5})  # it claims
    backend = block.build_backend()
    registry = UnitRegistry.from_model(Toy(layers=1))
    backend.wrap(registry.local_modules)
    backend.track_errors(registry.num_units)
    with pytest.raises(ValueError) as err:
        GNMRRuntime(registry, GNMRConfig(gamma=0.5), error_fn=backend.error_sums)
    assert str(err.value).startswith(
        "gnmr.gamma is set but the error source (the test_claims_errors backend) returned None "
        "instead of the float64 [U] error sums (docs/algorithm.md#damage-term): a backend whose "
        "class sets reports_errors = True must return them from error_sums"
    )


def _ds_config(tmp_path: Path, gnmr: dict) -> str:
    path = tmp_path / "gamma.json"
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "gnmr": gnmr})
    )
    return str(path)


@pytest.mark.parametrize("backend", [None, "test_rounded"])
def test_launch_check_and_preflight_refuse_it_as_the_run_would(capsys, tmp_path, backend):
    """``gnmr-launch check`` and the torchrun preflight (``--dry-run``: everything but the
    exec) exit 2 naming the key, the value and the fix; nothing starts."""
    config = _ds_config(tmp_path, {"backend": backend, "gamma": 0.5})
    for argv in (
        ["check", "--world-size", "2", config],
        ["torchrun", "--dry-run", "--nproc-per-node", "2", config],
    ):
        assert launch.main(argv) == 2
        err = capsys.readouterr().err
        assert f"{config} (deepspeed): " in err and "nothing was started" in err
        assert "gamma.json: gnmr.gamma scores the damage term" in err
        assert "set gnmr.backend to one that reports them (act_quant, fp8_emulated, int8" in err
        assert "Traceback" not in err


@pytest.mark.slow
def test_megatron_refuses_it_when_the_arguments_are_read(tmp_path):
    """Megatron-LM's set through ``gnmr-launch check`` (megatron's parse, then the block), and
    a user's own pretrain script through ``attach_from_argv()``: refused before megatron
    builds anything (was: only inside ``setup_model_and_optimizer``)."""
    from tests.integrations.megatron.settings import launch_checks, training_env

    block = tmp_path / "gamma.json"
    block.write_text(json.dumps({"backend": "act_quant", "gamma": 0.5}))
    check = f"check --world-size 2 megatron/demo_cpu --gnmr-config {block}"
    results = launch_checks(
        [shlex.split(check + " --gnmr-backend none"), shlex.split(check)], cwd=ROOT
    )
    (code, _, err), (fine, out, _) = results
    assert code == 2 and "nothing was started" in err
    assert "gamma.json: gnmr.gamma scores the damage term" in err
    assert "gnmr.backend=null (observe only) runs no low-cost path to measure" in err
    assert fine == 0 and "megatron/demo_cpu is valid" in out
    import subprocess
    import sys

    script = (
        "from gnmr_dist.train.megatron_flags import attach_from_argv\n"
        "from gnmr_dist.integrations.megatron.loop import attached\n"
        "try:\n    attach_from_argv(argv=sys.argv[1:])\n"
        "except ValueError as err:\n    print('refused:', err, attached())\n"
    )
    argv = ["--num-layers", "2", "--gnmr-config", str(block), "--gnmr-backend", "none"]
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + script, *argv],
        capture_output=True,
        text=True,
        env=training_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip().splitlines()[-1]
    assert said.startswith("refused: ") and said.endswith(" None")  # nothing attached
    assert "gnmr.gamma scores the damage term" in said and "runs no low-cost path" in said


def test_no_message_or_docstring_cites_the_design_cards_sections():
    """The damage term is docs/algorithm.md#damage-term, a page users have; "section 2.1" was
    a card outside the project."""
    cited = []
    for path in sorted((ROOT / "gnmr_dist").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and re.search(r"section 2\.1|section 2's", text):
                cited.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert cited == []
