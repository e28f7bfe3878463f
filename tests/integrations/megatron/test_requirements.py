"""Issue 41, item 5: the ``megatron`` extra installs what Megatron-LM's loop imports.

Read from the installed megatron-core's own sources with :mod:`ast` (no import of megatron):

* every module megatron imports unconditionally on the route GNMR ships (the closure of
  module-level ``megatron.*`` imports from ``pretrain``, the checkpoint save, the tokenizer and
  the GPT data set) is a distribution that ``pip install torch`` plus ``pip install
  "gnmr-dist[megatron]"`` installs (setup.py's lists, followed through each installed
  distribution's own requirements);
* every other module imported anywhere in the route's own packages (``megatron/training``, the
  checkpointing, tokenizers and data sets of megatron-core) is either installed by that route,
  in the program's table :data:`~gnmr_dist.integrations.megatron.loop.TRAINING_NEEDS` (checked
  at start), or in :data:`OPTIONAL` here with the reason megatron runs without it.

A megatron-core release that adds an import fails here, naming the module and the file, until
it is placed. The table's own packages (those every run needs, and those the shipped argument
sets ask for) are in the extra, and the developer venv (requirements/cpu.txt) holds them too.
A fresh-venv install of the extra is not run here: torch, the extra and megatron-core 0.17.1
take about 70 s and a first cold run with a checkpoint about 60 s more (measured), beyond the
budget of a packaging test; tests/integrations/megatron/test_preflight_modules.py checks the
program's refusal when one of these modules does not import.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from collections import defaultdict
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gnmr_dist.integrations.megatron import loop

ROOT = Path(__file__).resolve().parents[3]

ROUTE = (
    "megatron.training.training",
    "megatron.training.checkpointing",
    "megatron.training.global_vars",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.tokenizers.utils.build_tokenizer",
    "megatron.core.datasets.gpt_dataset",
)
"""Where ``gnmr-megatron-pretrain`` enters megatron: the loop, the checkpoint save and its
writer, the writers, the tokenizer and the GPT data set."""

PACKAGES = (
    "megatron/training",
    "megatron/core/dist_checkpointing",
    "megatron/core/tokenizers",
    "megatron/core/datasets",
)
"""The route's own packages, whose every import (conditional ones included) is placed."""

OPTIONAL = {
    "amp_C": "apex's CUDA kernels; megatron falls back to its local multi-tensor ops",
    "apex": "NVIDIA apex (CUDA); megatron falls back to torch's norm and optimizers",
    "transformer_engine": "--transformer-impl transformer_engine (CUDA); local layers on CPU",
    "modelopt": "NVIDIA ModelOpt: quantized export and distillation flags only",
    "nvidia_resiliency_ext": "--async-strategy nvrx and fault tolerance; mcore's writer without",
    "one_logger": "NVIDIA's e2e metrics; megatron warns once and goes on",
    "torch_memory_saver": "RL inference weight offloading flags only",
    "userlib": "--adlr-autoresume, a cluster's own library on SUBMIT_SCRIPTS",
    "workload_inspector": "the workload-inspector server flags only",
    "multistorageclient": "msc:// checkpoint and data paths only",
    "boto3": "s3:// data paths only",
    "botocore": "s3:// data paths only",
    "datasets": "Hugging Face SFT data sets (--sft) only",
    "wget": "downloading a Hugging Face tokenizer's vocabulary files only",
}
"""Modules the route's packages import that GNMR's route runs without, and why."""


def _megatron_root() -> Path:
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent.parent


def _source(root: Path, module: str) -> tuple[Path, bool] | None:
    base = root / module.replace(".", "/")
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return (base.with_suffix(".py"), False) if base.with_suffix(".py").is_file() else None


def _key(name: str) -> str:
    """The module a requirement is about: the top-level name, ``torch.utils.tensorboard`` whole
    (torch's module that needs the tensorboard package)."""
    tensorboard = "torch.utils.tensorboard"
    return tensorboard if name.startswith(tensorboard) else name.split(".")[0]


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, bool]]:
    """``(imported name, unconditional)`` of every import; unconditional: at module level and
    outside any ``try``, ``if`` or function body."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, plain: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((alias.name, plain) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                parts = module.split(".")
                base = parts[: len(parts) - child.level + is_package] if child.level else []
                name = ".".join([*base, *([child.module] if child.module else [])])
                out.append((name, plain))
                out.extend((f"{name}.{alias.name}", plain) for alias in child.names)
            nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.If, ast.Try)
            visit(child, plain and not isinstance(child, nested))

    visit(tree, True)
    return out


def _third_party(name: str) -> bool:
    return name.split(".")[0] not in {*sys.stdlib_module_names, "megatron"}


@functools.cache
def _route_imports(root: Path) -> dict[str, set[str]]:
    """Third-party modules imported unconditionally by the modules ``pretrain`` loads."""
    seen: set[str] = set()
    todo, found = list(ROUTE), defaultdict(set)
    while todo:
        module = todo.pop()
        source = _source(root, module)
        if module in seen or source is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for name, plain in _imports(ast.parse(source[0].read_text()), module, source[1]):
            if plain and name.startswith("megatron."):
                todo.append(name)
            elif plain and _third_party(name):
                found[_key(name)].add(module)
    assert len(seen) > 100, f"only {len(seen)} megatron modules reached: is ROUTE right?"
    return dict(found)


@functools.cache
def _package_imports(root: Path) -> dict[str, set[str]]:
    """Third-party modules imported anywhere in :data:`PACKAGES` (any condition)."""
    found = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            tree = ast.parse(path.read_text())
            for name, _ in _imports(tree, module, path.name == "__init__.py"):
                if _third_party(name):
                    found[_key(name)].add(str(path.relative_to(root)))
    return dict(found)


def _setup_lists() -> tuple[list[str], dict[str, list[str]]]:
    """``install_requires`` and ``extras_require`` of setup.py, read with ast."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }

    def strings(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Name):
            return strings(lists[node.id])
        assert isinstance(node, ast.List), ast.dump(node)
        out: list[str] = []
        for item in node.elts:
            out += strings(item.value) if isinstance(item, ast.Starred) else [item.value]
        return out

    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    kwargs = {k.arg: k.value for k in call.keywords}
    extras = kwargs["extras_require"]
    assert isinstance(extras, ast.Dict)
    named = {k.value: strings(v) for k, v in zip(extras.keys, extras.values, strict=True)}
    return strings(kwargs["install_requires"]), named


def _installs(requirements: list[str]) -> set[str]:
    """The distributions those requirements install here, through each one's own requirements
    (markers evaluated on this Python, no extras)."""
    out: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (req.marker and not req.marker.evaluate({"extra": ""})) or name in out:
            continue
        out.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} (required by the megatron route) is not installed in this venv")
    return out


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    """The installed distributions that provide ``module``."""
    top = "tensorboard" if module == "torch.utils.tensorboard" else module.split(".")[0]
    return {canonicalize_name(name) for name in _module_distributions().get(top, [])}


def _megatron_extra() -> list[str]:
    base, extras = _setup_lists()
    return ["torch", *base, *extras["megatron"]]


@pytest.mark.slow
def test_every_unconditional_import_on_the_route_is_installed_by_the_extra() -> None:
    root = _megatron_root()
    installed = _installs(_megatron_extra())
    missing = {
        module: sorted(users)[:3]
        for module, users in _route_imports(root).items()
        if not _distributions(module) & installed
    }
    assert not missing, (
        f"megatron imports these on pretrain's route unconditionally, and pip install "
        f"'gnmr-dist[megatron]' does not install them (add them to setup.py's MEGATRON_LM and "
        f"to gnmr_dist.integrations.megatron.loop.TRAINING_NEEDS): {missing}"
    )
    assert {"yaml", "numpy", "torch"} <= set(_route_imports(root))  # the scan does reach them


@pytest.mark.slow
def test_every_import_of_the_routes_packages_is_placed() -> None:
    root = _megatron_root()
    installed = _installs(_megatron_extra())
    checked = {need.module for need in loop.TRAINING_NEEDS}
    unplaced = {
        module: sorted(files)[:3]
        for module, files in _package_imports(root).items()
        if module not in checked
        and module not in OPTIONAL
        and not _distributions(module) & installed
    }
    assert not unplaced, (
        f"megatron-core's route imports modules neither installed by the megatron extra, nor "
        f"checked at start (loop.TRAINING_NEEDS), nor in OPTIONAL here: {unplaced}"
    )
    # the table is about what megatron imports: each of its modules is one of them
    imported = set(_package_imports(root)) | set(_route_imports(root))
    assert checked <= imported, checked - imported


def _shipped_needs() -> set[loop.Needed]:
    """The table's rows every run needs, and those a shipped argument set asks for."""
    needs = {need for need in loop.TRAINING_NEEDS if need.flag is None}
    for path in sorted((ROOT / "configs" / "megatron").glob("*.args")):
        words = [
            w
            for line in path.read_text().splitlines()
            if not line.startswith("#")
            for w in line.split()
        ]
        needs |= {need for need in loop.TRAINING_NEEDS if need.asked_by(words) is not None}
    return needs


def test_the_extra_and_the_dev_venv_hold_what_every_run_and_the_shipped_sets_need() -> None:
    needs = _shipped_needs()
    assert {n.package for n in needs} == {"pyyaml", "psutil", "tensorboard", "sentencepiece"}
    extra = {canonicalize_name(Requirement(r).name) for r in _megatron_extra()}
    pinned = {
        canonicalize_name(line.split("==")[0])
        for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for need in needs:
        package = canonicalize_name(need.package)
        assert package in extra, f"setup.py's megatron extra lacks {need.package} ({need.why})"
        assert package in pinned, f"requirements/cpu.txt lacks {need.package} ({need.why})"
        assert package in _distributions(need.module), (need.module, need.package)
