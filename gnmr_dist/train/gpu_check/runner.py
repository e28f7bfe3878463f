"""The GPU check's runner: each check caught, reported as it ends, and an exit code that says why.

Nothing here imports torch, Transformer Engine or megatron: a :class:`Check` is a name, what it
needs of the machine (:data:`NEEDS`), the recipes it runs and a function; :func:`run_checks` runs
a list of them in order and hands each :class:`Result` to a callback the moment it is known (the
program prints and flushes it, and rewrites its JSON file). A check's function returns an
:class:`Outcome` (passed or failed, with a one-line detail), raises :class:`Skip` when it cannot
run here, and any other exception is caught and reported as a crash with its traceback: one
broken check never loses the others' results.

:func:`exit_code` turns the results into the exit status of :data:`EXIT_CODES`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "EXIT_CODES",
    "NEEDS",
    "Check",
    "Machine",
    "Outcome",
    "Result",
    "Skip",
    "Status",
    "exit_code",
    "matches",
    "run_check",
    "run_checks",
    "select",
]

NEEDS = ("host", "cuda", "te", "megatron")
"""What a check needs, each level including the ones before it: ``host`` (any machine, pure
torch on the CPU), ``cuda`` (a CUDA device), ``te`` (and Transformer Engine), ``megatron`` (and
megatron-core)."""


class Status(str, Enum):
    """How one check ended."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"
    CRASH = "CRASH"
    NOT_RUN = "NOT-RUN"
    """The machine lacks what the check needs first of all (a CUDA device, Transformer Engine):
    the program says why in one line."""


EXIT_CODES: dict[int, str] = {
    0: "passed: every check that ran passed (with --require: every required check passed)",
    1: "failed: a check ran and what it compares did not hold",
    2: "usage: a bad argument or an unknown check name (nothing ran)",
    3: "crashed: a check raised an unexpected error (none failed)",
    4: "skipped: a check was skipped (with --require: a required one), none failed or crashed",
    5: "cannot run here: no CUDA device or no Transformer Engine; what can run here ran and passed",
}
"""The exit status and its meaning; when several apply the first of 1, 3, 5, 4 wins. With
``--require`` only the required checks' skips (4) and not-runs (5) count."""


class Skip(Exception):  # noqa: N818 (a control-flow signal, like StopIteration)
    """Raised by a check that cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class Outcome:
    """What a check that ran found."""

    ok: bool
    detail: str
    """One line: the numbers compared."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Everything else worth keeping (written to ``--json``), JSON-serialisable."""

    @classmethod
    def judged(
        cls, problems: Sequence[str], detail: str, data: Mapping[str, Any], *, prefix: str = ""
    ) -> Outcome:
        """Passed with ``detail`` when ``problems`` is empty; else failed, its detail the first
        four problems (after ``prefix``) and its data every problem besides ``data``."""
        if not problems:
            return cls(True, detail, data)
        return cls(False, prefix + "; ".join(problems[:4]), {"problems": list(problems), **data})


@dataclass(frozen=True)
class Check:
    """One named check."""

    name: str
    """``family`` or ``family[variant]``."""
    needs: str
    """One of :data:`NEEDS`."""
    compares: str
    """What it compares and what fails it, one sentence (``--list``)."""
    run: Callable[[Any], Outcome]
    """Called with the program's context."""
    recipes: tuple[str, ...] = ()
    """TE recipes that must run on this device (else SKIP with TE's reason)."""

    def __post_init__(self) -> None:
        if self.needs not in NEEDS:
            raise ValueError(f"check {self.name}: needs {self.needs!r}, not one of {NEEDS}")

    @property
    def family(self) -> str:
        return self.name.split("[", 1)[0]


@dataclass(frozen=True)
class Machine:
    """What this machine offers: each field ``None`` where it has it, else why not."""

    cuda: str | None
    te: str | None = None
    megatron: str | None = None
    recipes: Mapping[str, str | None] = field(default_factory=dict)
    """TE recipe -> ``None`` (runs on this device) or TE's reason it does not."""

    @property
    def cannot_run(self) -> str | None:
        """Why no GPU check can run here (no CUDA, or no TE), or ``None``."""
        return self.cuda or self.te

    def blocker(self, check: Check) -> tuple[Status, str] | None:
        """``(NOT_RUN or SKIP, reason)`` when ``check`` cannot run here, else ``None``."""
        level = NEEDS.index(check.needs)
        if level >= 1 and self.cuda is not None:
            return Status.NOT_RUN, self.cuda
        if level >= 2 and self.te is not None:
            return Status.NOT_RUN, self.te
        if level >= 3 and self.megatron is not None:
            return Status.SKIP, self.megatron
        for recipe in check.recipes:
            reason = self.recipes.get(recipe, f"recipe {recipe!r} was not probed")
            if reason is not None:
                return Status.SKIP, reason
        return None


@dataclass(frozen=True)
class Result:
    """How one check ended."""

    name: str
    status: Status
    detail: str
    seconds: float = 0.0
    data: Mapping[str, Any] = field(default_factory=dict)
    traceback: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
            "data": dict(self.data),
        }
        if self.traceback is not None:
            out["traceback"] = self.traceback
        return out


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_check(check: Check, context: Any, machine: Machine) -> Result:
    """Run one check, catching everything but ``KeyboardInterrupt``."""
    blocked = machine.blocker(check)
    if blocked is not None:
        return Result(check.name, blocked[0], _one_line(blocked[1]))
    start = time.perf_counter()
    try:
        outcome = check.run(context)
    except Skip as why:
        return Result(check.name, Status.SKIP, _one_line(str(why)), time.perf_counter() - start)
    except (Exception, SystemExit) as err:  # a check never takes the others down
        return Result(
            check.name,
            Status.CRASH,
            _one_line(f"{type(err).__name__}: {err}"),
            time.perf_counter() - start,
            traceback=traceback.format_exc(),
        )
    if not isinstance(outcome, Outcome):
        return Result(
            check.name,
            Status.CRASH,
            f"the check returned {type(outcome).__name__}, not an Outcome",
            time.perf_counter() - start,
        )
    status = Status.PASS if outcome.ok else Status.FAIL
    return Result(
        check.name,
        status,
        _one_line(outcome.detail, 600),
        time.perf_counter() - start,
        outcome.data,
    )


def run_checks(
    checks: Iterable[Check],
    context: Any,
    machine: Machine,
    report: Callable[[Result], None],
    between: Callable[[], None] | None = None,
) -> list[Result]:
    """Run ``checks`` in order; ``report`` gets each result as soon as it is known,
    ``between`` runs after each check that ran (freeing device memory)."""
    results = []
    for check in checks:
        result = run_check(check, context, machine)
        results.append(result)
        report(result)
        if between is not None and result.status is not Status.NOT_RUN:
            between()
    return results


def matches(pattern: str, name: str) -> bool:
    """A name matches itself and its family (``fp8_equal`` matches ``fp8_equal[delayed]``)."""
    return name == pattern or ("[" not in pattern and name.split("[", 1)[0] == pattern)


def select(checks: Sequence[Check], patterns: Collection[str]) -> list[Check]:
    """The checks that match one of ``patterns`` (all of them when there are none), in their
    order; a ``ValueError`` names a pattern that matches no check."""
    unknown = sorted(p for p in patterns if not any(matches(p, c.name) for c in checks))
    if unknown:
        raise ValueError(
            f"no check is called {', '.join(unknown)} (--list names every check; a family name "
            "such as fp8_equal stands for all of its checks)"
        )
    if not patterns:
        return list(checks)
    return [c for c in checks if any(matches(p, c.name) for p in patterns)]


def exit_code(results: Sequence[Result], required: Collection[str] = ()) -> int:
    """The exit status of :data:`EXIT_CODES`.

    A failure or a crash of any check counts. Without ``required`` so does every check that did
    not run (5 when the machine cannot run GPU checks at all, 4 for a skip); with it, only the
    required checks that did not run (the others may skip)."""
    statuses = {r.status for r in results}
    if Status.FAIL in statuses:
        return 1
    if Status.CRASH in statuses:
        return 3
    counted = (
        [r.status for r in results if any(matches(p, r.name) for p in required)]
        if required
        else [r.status for r in results]
    )
    if Status.NOT_RUN in counted:
        return 5
    if Status.SKIP in counted:
        return 4
    return 0
