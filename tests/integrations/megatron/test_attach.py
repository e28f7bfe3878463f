"""``megatron_patches.enable_loop`` / ``detach`` undo everything they patch, and ``import
megatron_patches`` loads at most a quarter of the package's modules (the rest on first use)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.requires import require

ROOT = Path(__file__).resolve().parents[3]


def _loaded_modules(statement: str) -> set[str]:
    """The gnmr_dist and megatron_patches modules ``statement`` imports in a fresh interpreter
    (``python -X importtime``: one line per module imported)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    return {n for n in names if n.split(".")[0] in ("gnmr_dist", "megatron_patches")}


def test_import_megatron_patches_loads_at_most_a_quarter_of_the_package():
    files = [*ROOT.glob("gnmr_dist/**/*.py"), *ROOT.glob("megatron_patches/**/*.py")]
    loaded = _loaded_modules("import megatron_patches")
    assert "megatron_patches" in loaded and len(loaded) <= len(files) / 4, sorted(loaded)
    assert not any(n.startswith("gnmr_dist.integrations.megatron.") for n in loaded), loaded
    assert not any(n.startswith("gnmr_dist.backends") for n in loaded), loaded


def test_megatron_patches_exports_its_public_names_only():
    import megatron_patches
    from gnmr_dist.integrations.megatron import gnmr, loop

    assert set(megatron_patches.__all__) >= {"enable", "disable", "enable_loop", "disable_loop"}
    assert megatron_patches.enable is gnmr.enable
    assert megatron_patches.disable_loop is loop.disable_loop
    for old in ("apply", "remove", "attach", "detach"):  # issue 45: aliases for one release
        assert old not in megatron_patches.__all__ and callable(getattr(megatron_patches, old))
    assert not any("cpu" in name for name in megatron_patches.__all__)  # test apparatus (#45)
    for name in ("loop", "gnmr", "cpu", "versions", "session"):
        with pytest.raises(AttributeError, match=name):
            getattr(megatron_patches, name)


class _Optimizer:
    def step(self) -> str:
        return "stepped"


def test_detach_puts_every_patched_attribute_back(monkeypatch):
    """After ``detach()`` each function ``attach`` wrapped is the original object again, and
    ``optimizer.step`` (wrapped by a step wrapper at setup) reads the class's method again."""
    require("megatron.training.training")
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import checkpointing, training

    import megatron_patches
    from gnmr_dist.integrations.megatron.loop import attached

    optimizer = _Optimizer()
    monkeypatch.setattr(training, "setup_model_and_optimizer", lambda: ([], optimizer, None))
    owners = {
        (training, "setup_model_and_optimizer"),
        (training, "training_log"),
        (training, "train"),
        (checkpointing, "generate_state_dict"),
        (checkpointing, "_load_base_checkpoint"),
        (dataset_utils, "compile_helpers"),
    }
    before = {(id(o), n): vars(o)[n] for o, n in owners}
    calls: list[str] = []

    def wrapper(model, step):
        def counted_step():
            calls.append("wrapped")
            return step()

        return counted_step

    megatron_patches.enable_loop(None, step_wrappers=[wrapper])
    try:
        assert all(vars(o)[n] is not before[(id(o), n)] for o, n in owners)
        with pytest.raises(RuntimeError, match="already attached"):
            megatron_patches.enable_loop(None)
        assert training.setup_model_and_optimizer()[1] is optimizer
        assert optimizer.step() == "stepped" and calls == ["wrapped"]
    finally:
        megatron_patches.disable_loop()
    assert all(vars(o)[n] is before[(id(o), n)] for o, n in owners)
    assert "step" not in vars(optimizer) and optimizer.step() == "stepped"
    assert attached() is None
    megatron_patches.disable_loop()  # a second detach is a no-op


SPAWNING_SCRIPT = """
import multiprocessing
from gnmr_dist.integrations.megatron.loop import attached
from gnmr_dist.train.megatron_flags import attach_from_argv

provider = attach_from_argv(argv=[])  # at module level, as a user's script may call it


def helper(queue):
    queue.put(attached() is None and callable(provider))


if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")  # how megatron's checkpoint writer starts
    queue = spawn.Queue()
    child = spawn.Process(target=helper, args=(queue,))
    child.start()
    nothing = queue.get(timeout=120)
    child.join()
    print("helper attached nothing:", nothing, "exit", child.exitcode)
    print("script attached:", attached() is not None)
"""


def test_a_spawned_helper_re_importing_the_script_attaches_nothing(tmp_path):
    """Issue 33, item 5: ``attach_from_argv()`` at module level ran again in every spawned
    helper (megatron's checkpoint writer re-imports the script as ``__mp_main__``); there it
    is now a no-op that returns the provider, while the script itself is attached."""
    script = tmp_path / "pretrain_mine.py"
    script.write_text(SPAWNING_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "helper attached nothing: True exit 0" in done.stdout
    assert "script attached: True" in done.stdout
