"""Installed backend plug-ins that fail to import (issue 41, item 4).

A real installed distribution (its ``*.dist-info`` with ``entry_points.txt``, as pip writes it)
on the path, naming three modules in the ``gnmr_dist.backends`` group: one that imports, one
whose dependency is missing, one that registers a backend and then fails. Every run loads the
group (unit discovery reads every backend's operator types), so a broken plug-in must break
only the runs that name its backends: the others go on after one warning that names the entry
point, its package, the module and the error; a run that names its backend is refused with that
error; ``gnmr-launch check`` says exactly what the run does.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_dist.backends import BACKENDS, get_backend, registered_operator_types
from gnmr_dist.backends import registry as registry_module
from gnmr_dist.backends.te_runtime import TE_MODULE_TYPES
from gnmr_dist.integrations.config import GNMRBlock
from tests.multiproc import torchrun

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("rc_ok_backend", "rc_missing_dep", "rc_half_backend")

OK = '''
from gnmr_dist.backends import register_backend
from tests.backends.external import RoundedBackend


@register_backend("rc_ok")
class Ok(RoundedBackend):
    """A plug-in that imports."""
'''

HALF = '''
from gnmr_dist.backends import register_backend
from tests.backends.external import RoundedBackend


@register_backend("half_fp")
class Half(RoundedBackend):
    """Registered, then its module fails."""


raise RuntimeError("half_fp: its CUDA kernels are not built")
'''

MISSING = "import rc_not_installed_dependency\n"

DEP = "ModuleNotFoundError: No module named 'rc_not_installed_dependency'"
SAID = {
    "missing": (
        "entry point missing_dep = 'rc_missing_dep' (group 'gnmr_dist.backends', package "
        f"rc-plugins 0.1) failed to import: {DEP}"
    ),
    "half": (
        "entry point half_fp = 'rc_half_backend' (group 'gnmr_dist.backends', package "
        "rc-plugins 0.1) failed to import: RuntimeError: half_fp: its CUDA kernels are not built"
    ),
}
"""How each broken entry point is named: entry point, module, package, the import's error."""


def _site(tmp_path: Path) -> Path:
    """A folder laid out as pip installs a distribution: modules and their ``dist-info``."""
    site = tmp_path / "site"
    info = site / "rc_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rc-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[gnmr_dist.backends]\nok = rc_ok_backend\nmissing_dep = rc_missing_dep\n"
        "half_fp = rc_half_backend\n"
    )
    for module, text in zip(MODULES, (OK, MISSING, HALF), strict=True):
        (site / f"{module}.py").write_text(text)
    return site


def _reload_entry_points() -> None:
    registry_module.load_entry_points.cache_clear()
    getattr(registry_module, "_BROKEN", []).clear()


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The distribution on ``sys.path``, the group loaded afresh; afterwards the registry as it
    was (the plug-ins' backends removed, the group reloaded without them when next used)."""
    site = _site(tmp_path)
    saved = dict(BACKENDS)
    loaded = set(sys.modules)  # the plug-ins import tests.backends.external, which registers
    monkeypatch.syspath_prepend(str(site))
    _reload_entry_points()
    yield site
    BACKENDS.clear()
    BACKENDS.update(saved)
    _reload_entry_points()
    for module in set(sys.modules) - loaded:  # a later import registers its backends again
        if module in MODULES or module.startswith("tests.backends."):
            sys.modules.pop(module, None)


def test_a_broken_plugin_breaks_no_run_that_does_not_use_it(installed, caplog):
    caplog.set_level(logging.WARNING, logger="gnmr_dist.backends.registry")
    assert registered_operator_types() >= TE_MODULE_TYPES  # unit discovery goes on
    assert registered_operator_types() >= TE_MODULE_TYPES  # (loaded once per process)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # once per broken entry point, not per call
    assert warned[0].startswith(f"gnmr: {SAID['missing']}; its backends are unavailable")
    assert warned[1].startswith(f"gnmr: {SAID['half']}; its backends are unavailable")
    assert "fix or uninstall rc-plugins 0.1" in warned[0]
    assert "rc_ok" in BACKENDS  # the plug-in that imports is there
    assert "half_fp" not in BACKENDS  # registered by a module that then failed: not run
    assert GNMRBlock.from_dict({"backend": "act_quant"}).build_backend().name == "act_quant"
    assert GNMRBlock.from_dict({"backend": "rc_ok"}).backend == "rc_ok"


def test_a_run_that_names_a_broken_plugins_backend_is_refused_with_its_error(installed):
    registered_operator_types()  # as unit discovery first loads the group
    for name, said in (("half_fp", SAID["half"]), ("missing_dep", SAID["missing"])):
        with pytest.raises(ValueError) as err:
            GNMRBlock.from_dict({"backend": name})
        assert str(err.value).startswith(
            f"gnmr.backend: backend {name!r} comes from an installed plug-in that failed to "
            f"import: {said}; fix that package"
        )
        with pytest.raises(ValueError, match=f"backend '{name}' comes from an installed plug-in"):
            get_backend(name)
    with pytest.raises(ValueError) as err:  # a name no entry point carries: any could be it
        GNMRBlock.from_dict({"backend": "mystery"})
    message = str(err.value)
    assert message.startswith("gnmr.backend: unknown backend 'mystery'")
    assert message.endswith(
        f"; it may come from a plug-in that failed to import: {SAID['missing']}; {SAID['half']}"
    )


def _env(site: Path) -> dict[str, str]:
    given = os.environ.get("PYTHONPATH", "")  # the plug-ins import tests.backends.external
    path = os.pathsep.join(p for p in (str(site), given, str(ROOT)) if p)
    return {**os.environ, "PYTHONPATH": path}


def _config(tmp_path: Path, backend: str) -> Path:
    path = tmp_path / f"{backend}.json"
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    block = {"backend": backend}
    path.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "gnmr": block})
    )
    return path


TINY = ["--steps", "2", "--layers", "1", "--hidden", "32", "--seq-len", "32", "--no-progress"]


@pytest.mark.slow
def test_check_gives_the_verdict_the_run_gives(tmp_path):
    """``gnmr-launch check`` and the program itself (one process under torchrun, 2 steps):
    the built-in backend passes and runs with the warning; the broken one's backend is refused
    by both with the same message (was: check valid, every run dead at unit discovery)."""
    env = _env(_site(tmp_path))
    verdicts = {}
    for backend in ("act_quant", "half_fp"):
        config = _config(tmp_path, backend)
        check = [sys.executable, "-m", "gnmr_dist.cli.launch", "check", "--world-size", "1"]
        checked = subprocess.run(
            [*check, str(config), *TINY], capture_output=True, text=True, env=env, timeout=300
        )
        program = [*torchrun(1), "-m", "gnmr_dist.cli.ds_pretrain", "--config", str(config)]
        run = subprocess.run(
            [*program, "--run-dir", str(tmp_path / backend), *TINY],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
        verdicts[backend] = checked, run
    checked, run = verdicts["act_quant"]
    assert checked.returncode == 0 and "act_quant.json is valid" in checked.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "act_quant" / "summary.json").is_file()
    for out in (checked.stderr, run.stderr):
        assert out.count(SAID["half"]) == 1 and out.count(SAID["missing"]) == 1
    checked, run = verdicts["half_fp"]
    refusal = "gnmr.backend: backend 'half_fp' comes from an installed plug-in that failed to "
    assert checked.returncode == 2 and "nothing was started" in checked.stderr
    assert run.returncode != 0 and not (tmp_path / "half_fp" / "summary.json").exists()
    for out in (checked.stderr, run.stderr):
        assert f"{refusal}import: {SAID['half']}; fix that package" in out
