"""docs/backends.md's own backend ("Writing a backend") runs exactly as printed (issue 33, item 3).

The code block is read from the markdown on every run (the one fenced ``python`` block of the
section that registers a backend) and executed unchanged, as the module a user would save it as;
the tests then hold it to what the page says of it: its name and its class docstring's
``"gnmr"`` block, option blocks checked by key, value and type (the message the page quotes),
both GEMM operands rounded to ``mantissa_bits`` on the low-cost path with a straight-through
backward, the module's own numbers on recovery. An edit of the page that stops the example
working fails here.
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from gnmr_dist.backends import BACKENDS, get_backend
from gnmr_dist.backends.registry import ENTRY_POINT_GROUP
from gnmr_dist.integrations.config import read_block

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"
SECTION = "## Writing a backend"
MODULE = "backends_md_example"
"""The name the block is executed under (as if saved as ``backends_md_example.py``)."""

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)


def _section(text: str) -> tuple[str, int]:
    """The text of :data:`SECTION` (up to the next ``## `` heading) and its first line's number."""
    start = text.index(f"\n{SECTION}\n") + 1
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)], text[:start].count("\n") + 1


def _blocks(lang: str) -> list[tuple[str, int]]:
    """``(code, line of its first line in the page)`` of each ``lang`` block of the section,
    with a list item's indent removed."""
    text, first = _section(DOC.read_text())
    found = []
    for fence in FENCE.finditer(text):
        if fence["lang"] == lang:
            indent = len(fence["indent"])
            code = "".join(line[indent:] for line in fence["body"].splitlines(keepends=True))
            found.append((code, first + text[: fence.start("body")].count("\n")))
    return found


def _example_code() -> tuple[str, int, str]:
    """The block that registers a backend, its line, and the name it registers."""
    blocks = [(code, line) for code, line in _blocks("python") if "@register_backend(" in code]
    assert len(blocks) == 1, f"{DOC}: {len(blocks)} python blocks register a backend in {SECTION}"
    code, line = blocks[0]
    (name,) = re.findall(r"@register_backend\(\"(\w+)\"\)", code)
    return code, line, name


@pytest.fixture
def example() -> Iterator[tuple[types.ModuleType, str]]:
    """The page's block executed as printed, in a module of its own; the registration is
    taken back afterwards, so no other test sees the doc's backend."""
    code, line, name = _example_code()
    assert name not in BACKENDS, f"the example's name {name!r} is taken by a shipped backend"
    module = types.ModuleType(MODULE)
    module.__file__ = f"{DOC}:{line}"
    sys.modules[MODULE] = module
    try:
        exec(compile(code, module.__file__, "exec"), module.__dict__)
        yield module, name
    finally:
        if name in BACKENDS and BACKENDS[name].__module__ == MODULE:
            del BACKENDS[name]
        del sys.modules[MODULE]


def _round_reference(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` to ``bits`` bits of mantissa, element by element in Python: ``x = m 2^e`` with
    ``0.5 <= |m| < 1``, ``m`` rounded to a multiple of ``2^-bits`` (half to even)."""

    def one(x: float) -> float:
        m, e = math.frexp(x)
        return math.ldexp(round(m * 2**bits) / 2**bits, e)

    return torch.tensor([one(x) for x in t.flatten().tolist()], dtype=t.dtype).view(t.shape)


def test_the_example_registers_the_backend_its_docstring_block_names(example):
    module, name = example
    cls = BACKENDS[name]
    assert cls.__module__ == MODULE and cls.name == name
    (given,) = re.findall(r"\{.*\}", " ".join(cls.__doc__.split()))  # the docstring's block
    block, backend = read_block(json.loads(given))
    assert block.backend == name and type(backend) is cls
    assert backend.low_cost == module.Rounding(mantissa_bits=3)
    assert backend.recovery == module.Exact()


def test_its_option_blocks_are_checked_as_the_page_says(example):
    """The refusal the page quotes for ``"mantissa_bits": "2"``, word for word; an unknown key
    names the closest; the recovery block takes no options."""
    _, name = example
    prose = " ".join(DOC.read_text().split())
    (quoted,) = re.findall(r'`"mantissa_bits": "2"` is refused as `([^`]+)`', prose)
    with pytest.raises(ValueError) as err:
        get_backend(name, low_cost={"mantissa_bits": "2"})
    assert str(err.value) == quoted
    with pytest.raises(ValueError, match=r"gnmr\.low_cost\.mantisa_bits; did you mean 'mantissa"):
        get_backend(name, low_cost={"mantisa_bits": 3})
    with pytest.raises(ValueError, match=r"unknown key gnmr\.recovery\.bits"):
        get_backend(name, recovery={"bits": 8})


def test_a_wrapped_linear_rounds_both_operands_on_low_cost_and_is_exact_on_recovery(example):
    """One forward and backward per path through a wrapped ``nn.Linear``, against the
    unwrapped copy and an element-wise reference of the rounding."""
    _, name = example
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    plain = copy.deepcopy(linear)
    backend = get_backend(name, low_cost={"mantissa_bits": 3})
    backend.wrap({0: linear})
    x = torch.randn(4, 16)
    dy = torch.randn(4, 8)
    xr, wr = _round_reference(x, 3), _round_reference(linear.weight.detach(), 3)
    assert not torch.equal(xr, x) and not torch.equal(wr, linear.weight)

    backend.apply([], step=1)  # every unit on the low-cost path
    given = x.clone().requires_grad_()
    y = linear(given)
    y.backward(dy)
    assert backend.report().low_cost == {0} and backend.report().recovered == frozenset()
    assert torch.equal(y, F.linear(xr, wr, linear.bias))
    assert not torch.equal(y, plain(x))
    # straight-through: the gradients of the rounded operands' GEMM, passed through the rounding
    torch.testing.assert_close(given.grad, dy @ wr)
    torch.testing.assert_close(linear.weight.grad, dy.T @ xr)
    torch.testing.assert_close(linear.bias.grad, dy.sum(0))

    linear.zero_grad()
    backend.apply([0], step=2)  # unit 0 on the recovery path: the module's own numbers
    given, reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, want = linear(given), plain(reference)
    y.backward(dy)
    want.backward(dy)
    assert backend.report().recovered == {0} and backend.report().low_cost == frozenset()
    assert torch.equal(y, want) and torch.equal(given.grad, reference.grad)
    assert torch.equal(linear.weight.grad, plain.weight.grad)

    backend.unwrap()
    assert "forward" not in vars(linear) and torch.equal(linear(x), plain(x))


def test_the_entry_point_snippet_names_the_group_the_programs_load():
    """The section's ``pyproject.toml`` lines declare a module in :data:`ENTRY_POINT_GROUP`
    (read line by line: ``tomllib`` is Python 3.11+)."""
    (toml, _), *more = _blocks("toml")
    assert not more
    header, *points = [line.strip() for line in toml.splitlines() if line.strip()]
    assert header == f'[project.entry-points."{ENTRY_POINT_GROUP}"]'
    assert points and all(re.fullmatch(r'\w+ = "\w+(\.\w+)*"', p) for p in points), points
