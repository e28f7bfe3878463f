"""An own backend in the shipped programs (issue 33, item 3): named with ``--import`` (Megatron:
``--gnmr-import``) or found through an installed package's ``gnmr_dist.backends`` entry point,
and seen by ``gnmr-launch check`` as by the run itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
from gnmr_dist.backends import register_backend
from tests.backends.external import RoundedBackend


@register_backend("ep_rounded")
class EntryPointRounded(RoundedBackend):
    """test_rounded under another name, registered by an installed package's entry point."""
'''


def _config(tmp_path: Path, backend: str) -> Path:
    path = tmp_path / f"{backend}.json"
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    block = {"backend": backend, "low_cost": {"mantissa_bits": 4}}
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "gnmr": block})
    )
    return path


def _check(config: Path, *extra: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "gnmr_dist.cli.launch", "check", "--world-size", "1", str(config)]
    return subprocess.run(
        [*cmd, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_import_flag_loads_an_own_backend_and_its_absence_names_the_flag(tmp_path):
    config = _config(tmp_path, "test_rounded")
    missing = _check(config)
    assert missing.returncode == 2
    assert (
        "unknown backend 'test_rounded'" in missing.stderr and "--import MODULE" in missing.stderr
    )
    found = _check(config, "--import", "tests.backends.external")
    assert found.returncode == 0, found.stderr[-3000:]
    assert f"{config} is valid" in found.stdout
    bad = _check(config, "--import", "tests.backends.no_such_module")
    assert bad.returncode == 2 and "--import tests.backends.no_such_module: cannot import" in (
        bad.stderr
    )


def test_an_installed_packages_entry_point_registers_its_backend(tmp_path):
    """A distribution on the path (its dist-info, as pip writes it) naming its module in the
    ``gnmr_dist.backends`` group: the backend runs with no flag."""
    site = tmp_path / "site"
    (site / "my_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "my_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n"
    )
    (site / "my_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[gnmr_dist.backends]\nrounded = my_plugin_backend\n"
    )
    (site / "my_plugin_backend.py").write_text(PLUGIN)
    config = _config(tmp_path, "ep_rounded")
    assert _check(config).returncode == 2  # not installed: unknown
    done = _check(config, pythonpath=str(site))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{config} is valid" in done.stdout


def test_megatron_gnmr_import_is_read_with_the_block(tmp_path):
    from gnmr_dist.train.megatron_flags import gnmr_block, gnmr_namespace

    block = tmp_path / "gnmr.json"
    block.write_text(json.dumps({"backend": "test_rounded"}))
    given = ["--gnmr-config", str(block), "--gnmr-import", "tests.backends.external"]
    assert gnmr_block(gnmr_namespace(given), check_host=False).backend == "test_rounded"
    given[-1] = "tests.backends.no_such_module"
    try:
        gnmr_block(gnmr_namespace(given), check_host=False)
    except ValueError as err:
        assert str(err).startswith("--gnmr-import tests.backends.no_such_module: cannot import")
    else:
        raise AssertionError("a module that does not import was accepted")
