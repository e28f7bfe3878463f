"""``gnmr-gpu-check``: ``te_fp8`` and the shadow route against Transformer Engine, on one GPU.

    gnmr-gpu-check [--list] [--json PATH] [--require NAME ...] [--only NAME ...]
                   [--hidden 4096] [--layers 2] [--tokens 16384] [--steps 12]

Run it on one GPU of the cluster, in the environment of the training run (its torch, its
Transformer Engine, its megatron-core), before a long run. Each check's line is printed and
flushed as it ends (``PASS`` / ``FAIL`` / ``SKIP`` / ``CRASH``), a check that raises never
stops the others, and ``--json`` is rewritten after every check. On a machine without CUDA or
without TE the checks that need none run and the program says in one line why the others did
not. Exit status: :data:`~gnmr_dist.train.gpu_check.runner.EXIT_CODES`. What each check
compares and what fails it: ``--list`` and docs/backends.md#gnmr-gpu-check.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gnmr_dist.train.gpu_check.common import RECIPES, Context, Sizes, free_device_memory
from gnmr_dist.train.gpu_check.runner import (
    EXIT_CODES,
    Check,
    Machine,
    Result,
    Status,
    exit_code,
    run_checks,
    select,
)

__all__ = ["build_parser", "detect", "main"]

PROG = "gnmr-gpu-check"


def _multiple_of_128(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 128 or value % 128:
        raise argparse.ArgumentTypeError(
            f"{value} is not a positive multiple of 128 (TE's block recipes tile by 128)"
        )
    return value


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def _limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is below 1 (a ratio of step times)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="exit status: "
        + "; ".join(f"{code} {text.split(':')[0]}" for code, text in EXIT_CODES.items()),
    )
    p.add_argument("--list", action="store_true", help="name every check and exit")
    p.add_argument("--json", metavar="PATH", help="write every result here (after each check)")
    p.add_argument(
        "--require",
        metavar="NAME",
        action="append",
        default=[],
        help="a check (or family, e.g. fp8_equal) that must pass: its skip makes the exit 4, "
        "other checks may skip (repeatable)",
    )
    p.add_argument(
        "--only", metavar="NAME", action="append", default=[], help="run only these (repeatable)"
    )
    size = p.add_argument_group("size", "the model checks, and tokens_per_s[large]")
    size.add_argument("--hidden", type=_multiple_of_128, default=Sizes.hidden, help="width")
    size.add_argument("--layers", type=_at_least(1), default=Sizes.layers, help="blocks")
    size.add_argument("--tokens", type=_multiple_of_128, default=Sizes.tokens, help="per batch")
    size.add_argument(
        "--steps", type=_at_least(4), default=Sizes.steps, help="training steps of switching"
    )
    speed = p.add_argument_group("tokens_per_s")
    speed.add_argument("--recipe", choices=RECIPES, default=Context.recipe, help="low-cost")
    speed.add_argument(
        "--small-limit", type=_limit, default=Context.small_limit, help="step-time ratio"
    )
    speed.add_argument(
        "--large-limit", type=_limit, default=Context.large_limit, help="step-time ratio"
    )
    p.add_argument("--workdir", metavar="DIR", help="keep the megatron traces here")
    return p


# ---------------------------------------------------------------------- the machine


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def detect() -> Machine:
    """What this machine offers (CUDA, TE and each recipe, megatron-core)."""
    if not torch.cuda.is_available():
        return Machine(cuda=f"CUDA is not available (torch {torch.__version__}, no CUDA device)")
    from gnmr_dist.backends.te_fp8 import TEFp8Backend

    try:
        TEFp8Backend()  # TE's default recipe: TE imports and this GPU runs FP8
    except ImportError as err:
        return Machine(cuda=None, te=f"Transformer Engine does not import: {_first_line(err)}")
    except RuntimeError as err:  # FP8 itself cannot run on this GPU
        return Machine(cuda=None, te=_first_line(err))
    recipes: dict[str, str | None] = {}
    for name in RECIPES:
        try:
            TEFp8Backend(low_cost={"recipe": name})
            recipes[name] = None
        except RuntimeError as err:
            recipes[name] = _first_line(err)
    return Machine(cuda=None, te=None, megatron=_megatron_missing(), recipes=recipes)


def _megatron_missing() -> str | None:
    """Why megatron-core cannot be used here, or ``None``."""
    try:
        importlib.import_module("megatron.core")
    except Exception as err:  # megatron's import fails with more than ImportError
        return f"megatron-core is not importable ({_first_line(err)})"
    return None


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda or "none")}
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        out["device"] = f"{torch.cuda.get_device_name()} ({major}.{minor})"
    for name in ("transformer_engine", "megatron.core"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = str(getattr(module, "__version__", "?"))
    return out


# ---------------------------------------------------------------------- reporting


def _line(r: Result) -> str:
    line = f"{r.status.value:5}  {r.name:36} {r.seconds:7.1f} s  {r.detail}"
    if r.status is Status.CRASH and r.traceback:
        frames = [ln.strip() for ln in r.traceback.splitlines() if ln.strip().startswith("File ")]
        if frames:
            line += f"\n       at {frames[-1]}"
    return line


class Report:
    """Prints each result as it ends and keeps the ``--json`` file current."""

    def __init__(self, path: Path | None, head: dict[str, Any]) -> None:
        self.path, self.head, self.results = path, head, list[Result]()
        self.not_run = 0

    def __call__(self, result: Result) -> None:
        self.results.append(result)
        if result.status is Status.NOT_RUN:
            self.not_run += 1
        else:
            print(_line(result), flush=True)
        self.write(finished=False)

    def write(self, *, finished: bool, code: int | None = None) -> None:
        if self.path is None:
            return
        doc = {
            **self.head,
            "finished": finished,
            "checks": [r.to_json() for r in self.results],
            "summary": summary(self.results),
        }
        if code is not None:
            doc.update(exit_code=code, exit_meaning=EXIT_CODES[code])
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, self.path)


_WORDS = {
    Status.PASS: "passed",
    Status.FAIL: "failed",
    Status.SKIP: "skipped",
    Status.CRASH: "crashed",
    Status.NOT_RUN: "not run here",
}


def summary(results: Sequence[Result]) -> dict[str, int]:
    """How many checks ended how (``--json``'s ``summary``)."""
    return {_WORDS[s]: sum(r.status is s for r in results) for s in Status}


def _list(checks: Sequence[Check]) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.name:{width}}  [{c.needs}]  {c.compares}")
    print(f"{len(checks)} checks; [needs]: host (any machine), cuda, te (and TE), megatron")


def main(
    argv: Sequence[str] | None = None,
    *,
    checks: Sequence[Check] | None = None,
    machine: Machine | None = None,
) -> int:
    """Run the checks (``checks``: a list other than the catalog's; ``machine``: what this
    machine offers, default :func:`detect`); the exit status of ``EXIT_CODES``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if checks is None:
        from gnmr_dist.train.gpu_check.catalog import catalog

        checks = catalog()
    if args.list:
        _list(checks)
        return 0
    try:
        chosen = select(checks, args.only)
        select(chosen, args.require)
    except ValueError as err:
        parser.error(str(err))
    path = Path(args.json) if args.json else None
    if path is not None and not path.parent.is_dir():
        parser.error(f"--json {path}: the folder {path.parent} does not exist")
    machine = machine if machine is not None else detect()
    sizes = Sizes(args.hidden, args.layers, args.tokens, args.steps)
    head = {
        "tool": PROG,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": _versions(),
        "cannot_run": machine.cannot_run,
        "recipes": dict(machine.recipes),
        "megatron": "not probed" if machine.cannot_run else (machine.megatron or "importable"),
        "sizes": vars(sizes),
    }
    report = Report(path, head)
    print(f"{PROG}: " + ", ".join(f"{k} {v}" for k, v in _versions().items()), flush=True)
    for name, why in machine.recipes.items():
        if why is not None:
            print(f"  recipe {name} does not run here: {why}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gnmr-gpu-check-") as scratch:
        context = Context(
            sizes=sizes,
            workdir=Path(args.workdir or scratch),
            small_limit=args.small_limit,
            large_limit=args.large_limit,
            recipe=args.recipe,
        )
        context.workdir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            between = free_device_memory if torch.cuda.is_available() else None
            results = run_checks(chosen, context, machine, report, between)
        except KeyboardInterrupt:
            report.write(finished=False)
            print(f"{PROG}: interrupted after {len(report.results)} checks", file=sys.stderr)
            return 130
    code = exit_code(results, args.require)
    counts = summary(results)
    took = time.perf_counter() - start
    print(
        f"{PROG}: "
        + ", ".join(f"{n} {s.lower()}" for s, n in counts.items() if n)
        + f" in {took:.0f} s; exit {code}: {EXIT_CODES[code]}",
        flush=True,
    )
    if machine.cannot_run is not None and report.not_run:
        print(
            f"{PROG}: cannot run here: {machine.cannot_run} ({report.not_run} of the checks "
            "need it)",
            file=sys.stderr,
            flush=True,
        )
    report.write(finished=True, code=code)
    return code
