"""Every repository path and module a document or docstring names exists, and docstrings stay short.

The documents are ``README.md``, ``tests/README.md``, ``docs/*.md`` and ``benchmarks/RESULTS.md``;
the docstrings are those of every module, class and function under :data:`PACKAGES` (read with
:mod:`ast`). A *path* is a token that starts with one of the repository's top-level folders
(``gnmr_dist/backends/base.py``, ``docs/algorithm.md#damage-term``: the anchor must be one of the
page's headings too); a *module* is a dotted name rooted in one of :data:`PACKAGES`
(``gnmr_dist.core.controller.GNMRController``: imported, and each name after the module looked
up on it). Globs and placeholders (``*``, ``<``, ``{``) are skipped.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import types
from functools import cache
from pathlib import Path

from tests.test_layout import PACKAGES, ROOT, _tree

FOLDERS = (*PACKAGES, "tests", "docs", "configs", "launch", "docker", "requirements", ".ci")
DOCUMENTS = ("README.md", "tests/README.md", "benchmarks/RESULTS.md")
FILE_SUFFIXES = {"md", "py", "json", "jsonl", "png", "j2", "hjson", "txt", "sh", "toml"}
MODULE_DOCSTRING_LINES = 30
"""The most lines a module docstring may take; longer explanations belong in ``docs/``."""

_ROOTS = "|".join(map(re.escape, FOLDERS))
_PATH = re.compile(rf"(?<![\w/.-])((?:{_ROOTS})/[\w./#*<>{{}}-]*[\w*>}}])")
_MODULE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)")


@cache
def _trees() -> dict[str, ast.Module]:
    """Every source file of :data:`PACKAGES` (``test_layout``'s tree), parsed once."""
    return {path: ast.parse(text, filename=path) for path, text in _tree().items()}


def _texts() -> dict[str, str]:
    """Relative path -> text of every document and every docstring (one entry per docstring)."""
    out = {d: (ROOT / d).read_text(encoding="utf-8") for d in DOCUMENTS}
    out |= {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in ROOT.glob("docs/*.md")}
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    out[f"{path}:{getattr(node, 'lineno', 1)}"] = doc
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but ``_`` and ``-`` dropped,
    spaces to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    lines = page.read_text(encoding="utf-8").splitlines()
    return frozenset(_slug(line.lstrip("#")) for line in lines if line.startswith("#"))


def _missing_path(token: str) -> str | None:
    """Why ``token`` does not name an existing path (and heading), or None when it does."""
    if any(c in token for c in "*<>{}"):
        return None
    path, _, anchor = token.rstrip(".").partition("#")
    target = ROOT / path
    if not target.exists():
        return "no such path"
    if anchor and target.suffix == ".md" and anchor not in _anchors(target):
        return f"no heading #{anchor}"
    return None


_MISSING = object()


def _attribute(obj: object, name: str) -> object:
    """``obj.name`` (a dataclass field's default too), or the submodule ``name`` of package
    ``obj`` (imported), or :data:`_MISSING`."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if name in getattr(obj, "__dataclass_fields__", {}):
        return obj.__dataclass_fields__[name].type  # type: ignore[attr-defined]
    if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
        try:
            return importlib.import_module(f"{obj.__name__}.{name}")
        except ModuleNotFoundError:
            return _MISSING
    return _MISSING


def _missing_module(name: str) -> str | None:
    """Why dotted ``name`` names nothing: its longest importable module prefix is imported and
    the rest is looked up on it attribute by attribute (a lazy ``__getattr__`` answers too)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(prefix) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(prefix)
        for depth, attribute in enumerate(parts[cut:], start=cut):
            obj = _attribute(obj, attribute)
            if obj is _MISSING:
                return f"{'.'.join(parts[:depth])} has no {attribute}"
        return None
    return "no such module"


def _not_a_module(token: str) -> bool:
    """A file name (``benchmarks.md``), a logger's public name that is not a module's, or a name
    ``megatron_patches`` no longer exports (``megatron_patches.REMOVED``: the docs name the old
    call, which raises an error naming its successor)."""
    import megatron_patches
    from gnmr_dist.integrations.console import LOGGER

    head, _, rest = token.partition(".")
    removed = head == "megatron_patches" and rest.split(".")[0] in megatron_patches.REMOVED
    return token.rpartition(".")[2] in FILE_SUFFIXES or token == LOGGER or removed


def dangling_names(texts: dict[str, str]) -> list[str]:
    """``where: name (why)`` for every path or module in ``texts`` that does not exist."""
    problems = []
    for where, text in texts.items():
        for token in sorted(set(_PATH.findall(text))):
            why = _missing_path(token)
            if why:
                problems.append(f"{where}: {token} ({why})")
        for token in sorted(set(_MODULE.findall(text))):
            why = None if _not_a_module(token) else _missing_module(token)
            if why:
                problems.append(f"{where}: {token} ({why})")
    return problems


def long_module_docstrings() -> list[str]:
    """``path: N lines`` for every module docstring over :data:`MODULE_DOCSTRING_LINES`."""
    out = []
    for path, tree in _trees().items():
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.splitlines()) > MODULE_DOCSTRING_LINES:
            out.append(f"{path}: {len(doc.splitlines())} lines")
    return out


def test_every_named_path_and_module_exists():
    assert dangling_names(_texts()) == []


def test_a_dangling_path_a_missing_heading_and_a_missing_name_are_caught():
    found = dangling_names(
        {
            "x": "see gnmr_dist/core/nowhere.py, docs/algorithm.md#no-such-heading and "
            "gnmr_dist.core.controller.no_such_name_here; gnmr_dist/core/controller.py is fine, "
            "as is benchmarks/results/fp4/*.jsonl"
        }
    )
    assert found == [
        "x: docs/algorithm.md#no-such-heading (no heading #no-such-heading)",
        "x: gnmr_dist/core/nowhere.py (no such path)",
        "x: gnmr_dist.core.controller.no_such_name_here "
        "(gnmr_dist.core.controller has no no_such_name_here)",
    ]


def test_module_docstrings_are_short():
    assert long_module_docstrings() == []
