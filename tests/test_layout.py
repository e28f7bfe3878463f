"""The import graph of gnmr-dist points down its layers, never up (README, "Layout").

Every import in the source tree, at module level or inside a function (the lazy imports of
DeepSpeed-, megatron- and TE-facing code are arrows too), is read with :mod:`ast` and resolved
to the layer of the longest matching prefix in :data:`LAYERS`. A module may import its own
prefix and any lower layer; an import of a higher layer, or of a sibling prefix on the same
layer, is an upward arrow and fails the test with the file and line. A module no layer claims
fails too, so a new package takes a place in the table first.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gnmr_dist", "megatron_patches", "benchmarks")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("gnmr_dist.state",),  # the saved state's one owner: torch and numpy only
    ("gnmr_dist.core",),  # the algorithm: torch and numpy only
    ("gnmr_dist.distributed", "gnmr_dist.telemetry", "gnmr_dist.data"),
    ("gnmr_dist.backends",),  # precision paths, switched per unit
    ("gnmr_dist.integrations.config",),  # the "gnmr" block, read once
    ("gnmr_dist.integrations.session", "gnmr_dist.integrations.state_file"),
    ("gnmr_dist.integrations",),  # framework glue: DeepSpeed, megatron-core, Trainer
    ("gnmr_dist.deepspeed", "megatron_patches", "gnmr_dist"),  # the public names
    ("gnmr_dist.testing",),  # test apparatus: CPU stand-ins, drills, the torch reference
    ("gnmr_dist.train.common",),
    ("gnmr_dist.train",),  # the programs
    ("gnmr_dist.cli",),  # thin entry points
    ("benchmarks.harness",),  # the model, arms, training loop and branch estimator
    ("benchmarks.overhead", "benchmarks.paper", "benchmarks.sweep", "benchmarks.gpu"),  # studies
    ("benchmarks.report",),  # RESULTS.md from its template, reading result files only
    ("benchmarks",),
)
"""Lowest first. ``"gnmr_dist"`` is the root package's ``__init__`` alone (longer prefixes win)."""


def _place(module: str) -> tuple[int, str] | None:
    """(layer, prefix) of the longest prefix in :data:`LAYERS` that ``module`` falls under."""
    best: tuple[int, str] | None = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            under = module == prefix or (module.startswith(prefix + ".") and prefix != "gnmr_dist")
            if under and (best is None or len(prefix) > len(best[1])):
                best = (level, prefix)
    return best


def _module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import of one of :data:`PACKAGES`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] in PACKAGES]


def _resolve(name: str, modules: set[str]) -> str:
    """``name`` cut back to the longest prefix that is a module of the tree."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


DEPRECATED_BRIDGES = {
    "gnmr_dist.core": "gnmr_dist.testing.scores",
    "megatron_patches": "gnmr_dist.testing.megatron_cpu",
}
"""Product modules that may import the testing package, inside a function only: the deprecated
aliases of names that moved there in issue 45 (``gnmr_dist.core.risk_scores`` and friends,
``megatron_patches.enable_cpu_compat`` and friends), for one release."""


def _lazy_lines(tree: ast.AST) -> set[int]:
    """Lines of the imports that run only when called (inside a function) or never (under
    ``if TYPE_CHECKING``)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        typing_only = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or typing_only:
            lines |= {
                n.lineno for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)
            }
    return lines


def imports_of_testing(sources: dict[str, str]) -> list[str]:
    """Every import of ``gnmr_dist.testing`` the product's rooms make: none at all, but the
    programs' (``gnmr_dist.train``, ``gnmr_dist.cli``: their drill flags, the CPU switch of
    ``gnmr-megatron-pretrain``) and :data:`DEPRECATED_BRIDGES`, and those only lazily."""
    problems = []
    for path, text in sorted(sources.items()):
        module = _module_name(Path(path))
        if module == "gnmr_dist.testing" or module.startswith("gnmr_dist.testing."):
            continue
        tree = ast.parse(text, filename=path)
        lazy = _lazy_lines(tree)
        programs = module.startswith(("gnmr_dist.train", "gnmr_dist.cli", "benchmarks"))
        for line, target in _targets(tree, module, path.endswith("__init__.py")):
            if not (target == "gnmr_dist.testing" or target.startswith("gnmr_dist.testing.")):
                continue
            bridge = DEPRECATED_BRIDGES.get(module)
            allowed = programs or (bridge is not None and target.startswith(bridge))
            if not (allowed and line in lazy):
                problems.append(f"{path}:{line}: {module} imports {target}")
    return problems


def upward_imports(sources: dict[str, str]) -> list[str]:
    """Every arrow against :data:`LAYERS` in ``sources`` (relative path -> text); the lazy
    imports of :data:`DEPRECATED_BRIDGES` are :func:`imports_of_testing`' to judge."""
    names = {_module_name(Path(p)): (p, text) for p, text in sources.items()}
    problems = []
    for module, (path, text) in sorted(names.items()):
        here = _place(module)
        if here is None:
            problems.append(f"{path}: {module} is in no layer of LAYERS")
            continue
        tree = ast.parse(text, filename=path)
        for line, target in _targets(tree, module, path.endswith("__init__.py")):
            there = _place(_resolve(target, set(names)))
            if there is None or there[1] == here[1] or there[0] < here[0]:
                continue
            if there[1] == "gnmr_dist.testing" and module in DEPRECATED_BRIDGES:
                continue
            problems.append(
                f"{path}:{line}: {module} (layer {here[0]}, {here[1]}) imports {target} "
                f"(layer {there[0]}, {there[1]})"
            )
    return problems


def _tree() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
    }


def test_every_import_points_down_the_layers():
    assert upward_imports(_tree()) == []


def test_an_upward_import_is_caught_at_module_level_and_inside_a_function():
    sources = _tree()
    state = "gnmr_dist/state/controller.py"
    sources[state] += "\n\ndef _late():\n    from gnmr_dist.train.common import setup_logging\n"
    sources["gnmr_dist/backends/base.py"] += "\nimport gnmr_dist.integrations.session\n"
    sources["gnmr_dist/telemetry/trace.py"] += "\nfrom gnmr_dist.distributed import comm\n"
    found = upward_imports(sources)
    assert len(found) == 3, found
    assert found[0].startswith("gnmr_dist/backends/base.py:") and "integrations.session" in found[0]
    assert "gnmr_dist.state.controller (layer 0" in found[1] and "train.common" in found[1]
    assert "telemetry.trace" in found[2] and "(layer 2, gnmr_dist.distributed)" in found[2]


def test_a_module_outside_every_layer_is_named():
    sources = {**_tree(), "gnmr_dist_extra/x.py": "import gnmr_dist\n"}
    assert upward_imports(sources) == [
        "gnmr_dist_extra/x.py: gnmr_dist_extra.x is in no layer of LAYERS"
    ]


def test_the_product_never_imports_the_testing_package():
    assert imports_of_testing(_tree()) == []


def test_an_import_of_the_testing_package_by_the_product_is_caught():
    """At module level anywhere outside the programs, inside a function outside the programs
    and the deprecated bridges, and at module level in a program; a program's lazy import and
    a bridge's lazy alias pass."""
    sources = _tree()
    sources["gnmr_dist/backends/base.py"] += "\nfrom gnmr_dist.testing import scores\n"
    sources["gnmr_dist/integrations/session.py"] += (
        "\n\ndef _late():\n    from gnmr_dist.testing.megatron_cpu import cpu_compat\n"
    )
    sources["gnmr_dist/train/launch.py"] += "\nimport gnmr_dist.testing.drills\n"
    sources["gnmr_dist/train/common.py"] += (
        "\n\ndef _drill():\n    from gnmr_dist.testing.drills import restart_drill\n"
    )
    found = imports_of_testing(sources)
    assert len(found) == 3, found
    assert found[0].startswith("gnmr_dist/backends/base.py:") and "testing.scores" in found[0]
    assert found[1].startswith("gnmr_dist/integrations/session.py:")
    assert found[2].startswith("gnmr_dist/train/launch.py:")
    placed = _place("gnmr_dist.testing.megatron_cpu.writer")  # covered by the table
    assert placed is not None and placed[1] == "gnmr_dist.testing"


def test_the_report_reads_result_files_and_the_harness_only():
    """RESULTS.md is rendered from result files: the report imports no study family, only the
    harness floor's pure helpers (statistics, tables), so it cannot run or re-derive a study."""
    names = {_module_name(Path(p)): (p, text) for p, text in _tree().items()}
    studies = ("benchmarks.overhead", "benchmarks.paper", "benchmarks.sweep", "benchmarks.gpu")
    found = [
        f"{path}:{line}: {target}"
        for module, (path, text) in names.items()
        if module.startswith("benchmarks.report")
        for line, target in _targets(ast.parse(text), module, path.endswith("__init__.py"))
        if target.startswith(studies)
    ]
    assert found == []


# ------------------------------------------------------------------------ the framework boundary

FRAMEWORK_FREE = (
    "gnmr_dist.state",
    "gnmr_dist.core",
    "gnmr_dist.distributed",
    "gnmr_dist.telemetry",
    "gnmr_dist.backends",
)
"""Packages that import and name no training framework: every framework fact lives in
``gnmr_dist.integrations`` (``deepspeed/``, ``megatron/``), which passes what these need
(operator adapters, parameter marks, process groups) in as arguments. Transformer Engine is not a
training framework but the library the ``te_fp8`` backend wraps, so ``backends`` may import it."""

FRAMEWORKS = ("deepspeed", "megatron", "megatron_patches", "transformers", "accelerate", "peft")
"""Top-level packages of the training frameworks (and the design card's megatron glue)."""

_FRAMEWORK_WORD = ("megatron", "deepspeed", "trainer", "accelerate")
"""A name holding one of these (any case) is a framework fact."""


def _names(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, identifier)`` of every name the code defines or reads (not strings or docs;
    imports are checked by module)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, node.arg))
    return out


def framework_facts(sources: dict[str, str]) -> list[str]:
    """Every import of a framework and every framework-named identifier in
    :data:`FRAMEWORK_FREE` packages of ``sources`` (relative path -> text)."""
    problems = []
    for path, text in sorted(sources.items()):
        module = _module_name(Path(path))
        if not any(module == p or module.startswith(p + ".") for p in FRAMEWORK_FREE):
            continue
        tree = ast.parse(text, filename=path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in FRAMEWORKS:
                    problems.append(f"{path}:{node.lineno}: imports {name}")
        for line, name in _names(tree):
            if any(word in name.lower() for word in _FRAMEWORK_WORD):
                problems.append(f"{path}:{line}: framework-named identifier {name}")
    return sorted(set(problems))


def test_no_framework_below_the_integrations():
    assert framework_facts(_tree()) == []


def test_a_framework_fact_below_the_integrations_is_caught():
    sources = _tree()
    sources["gnmr_dist/distributed/units.py"] += (
        '\nMEGATRON_LINEARS = frozenset({"ColumnParallelLinear"})\n'
    )
    sources["gnmr_dist/backends/base.py"] += (
        "\n\ndef _late():\n    from megatron.core.tensor_parallel import mappings\n"
    )
    sources["gnmr_dist/state/controller.py"] += "\nimport deepspeed.comm\n"
    sources["gnmr_dist/integrations/session.py"] += "\nimport deepspeed\n"  # allowed there
    found = framework_facts(sources)
    assert len(found) == 3, found
    assert found[0].startswith("gnmr_dist/backends/base.py:") and "megatron.core" in found[0]
    assert found[1].startswith("gnmr_dist/distributed/units.py:") and "MEGATRON_LINEARS" in found[1]
    assert found[2].startswith("gnmr_dist/state/controller.py:") and "deepspeed.comm" in found[2]
