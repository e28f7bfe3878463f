"""Write the pip constraints the image build installs under (run by docker/Dockerfile).

    python3 docker/pin_image.py --project requirements/constraints-cpu.txt \\
        --out /opt/gnmr-dist/constraints-image.txt --expect-python 3.12 --expect-te-major 2
    python3 docker/pin_image.py --verify /opt/gnmr-dist/constraints-image.txt

The NGC base image ships a CUDA build of torch, Transformer Engine, apex and friends compiled
against each other and against its numpy. Nothing the build installs may replace them, so the
constraints file holds, in this order:

1. the base image's compiled stack, exactly as installed (``torch``, ``triton``, ``numpy``,
   ``transformer_engine*``, ``apex``, ``flash_attn*``, ``nvidia-*``, ...): pip fails rather than
   swap one of them;
2. the project's CI pins (``requirements/constraints-cpu.txt``) for the packages the image does
   NOT already have, so what is new in the image is what CI tested. A package the image already
   ships is left at the image's version unless a pinned requirement needs another one.

``--expect-python`` and ``--expect-te-major`` turn the base image's promises into build errors
(read from package metadata: Transformer Engine is not imported, as a build host has no GPU).
``--verify`` re-reads a written file after the installs and fails if a pinned package of part 1
changed or disappeared.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

IMAGE_STACK = re.compile(
    r"^(torch|torchvision|torchaudio|triton|pytorch-triton|numpy|apex|cuda-python|cuda-bindings"
    r"|transformer-engine(-.*)?|flash-attn(-.*)?|nvidia-.*|cupy(-.*)?)$"
)
"""Normalized names of the base image's compiled packages, pinned exactly as installed."""

TE_DISTRIBUTIONS = ("transformer-engine", "transformer-engine-torch")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*==\s*([^\s;#]+)")


def normalize(name: str) -> str:
    """The PEP 503 form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, tuple[str, str]]:
    """normalized name -> (name, version) of every distribution on ``sys.path`` (first wins)."""
    found: dict[str, tuple[str, str]] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), (name, dist.version))
    return found


def parse_pins(lines: Iterable[str]) -> list[tuple[str, str]]:
    """``(name, version)`` of every ``name==version`` line; comments and blanks skipped."""
    pins = []
    for line in lines:
        m = _REQ_NAME.match(line.split("#", 1)[0])
        if m:
            pins.append((m.group(1), m.group(3)))
    return pins


def build(image: Mapping[str, tuple[str, str]], project: Sequence[tuple[str, str]]) -> list[str]:
    """The constraints file's lines: the image's compiled stack, then the project's new pins."""
    stack = sorted((n, v) for key, (n, v) in image.items() if IMAGE_STACK.match(key))
    if not any(normalize(n) == "torch" for n, _ in stack):
        raise SystemExit("pin_image: no torch installed here: not an NGC PyTorch image?")
    new = [(n, v) for n, v in project if normalize(n) not in image]
    out = [
        "# Written by docker/pin_image.py at image build time.",
        "# 1. the base image's own compiled stack, exact",
    ]
    out += [f"{n}=={v}" for n, v in stack]
    out.append("# 2. requirements/constraints-cpu.txt, for packages the base image does not ship")
    out += [f"{n}=={v}" for n, v in new]
    return out


def check_expectations(
    image: Mapping[str, tuple[str, str]], python: str | None, te_major: int | None
) -> list[str]:
    """Problems with the base image: wrong Python, missing or too old Transformer Engine."""
    problems = []
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python and here != python:
        problems.append(f"Python {here}, expected {python}")
    if te_major is not None:
        te = [image[d][1] for d in TE_DISTRIBUTIONS if d in image]
        if not te:
            problems.append("Transformer Engine is not installed (the base image should ship it)")
        elif int(re.match(r"\d+", te[0]).group()) < te_major:  # type: ignore[union-attr]
            problems.append(f"Transformer Engine {te[0]}, expected {te_major}.x or later")
    return problems


def verify(path: Path, image: Mapping[str, tuple[str, str]]) -> list[str]:
    """Pins of part 1 of ``path`` that no longer match what is installed."""
    problems = []
    for name, version in parse_pins(path.read_text(encoding="utf-8").splitlines()):
        key = normalize(name)
        if not IMAGE_STACK.match(key):
            continue
        have = image.get(key)
        if have is None:
            problems.append(f"{name}=={version} was removed")
        elif have[1] != version:
            problems.append(f"{name} changed from {version} to {have[1]}")
    return problems


def _say(text: str, err: bool = False) -> None:
    (sys.stderr if err else sys.stdout).write(text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pin_image.py", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path, help="constraints file to write")
    g.add_argument("--verify", type=Path, metavar="FILE", help="check a written file instead")
    p.add_argument("--project", type=Path, help="the project's pins (constraints-cpu.txt)")
    p.add_argument("--expect-python", metavar="X.Y", help="fail unless this Python runs")
    p.add_argument("--expect-te-major", type=int, metavar="N", help="fail unless TE >= N.0")
    args = p.parse_args(argv)
    image = installed()
    if args.verify:
        if not args.verify.is_file():
            _say(f"pin_image: no constraints file {args.verify}", err=True)
            return 1
        problems = verify(args.verify, image)
        for line in problems:
            _say(f"pin_image: the base image's {line}", err=True)
        if not problems:
            _say(f"pin_image: the base image's compiled stack is unchanged ({args.verify})")
        return 1 if problems else 0
    problems = check_expectations(image, args.expect_python, args.expect_te_major)
    for line in problems:
        _say(f"pin_image: {line}", err=True)
    if problems:
        return 1
    project = []
    if args.project:
        project = parse_pins(args.project.read_text(encoding="utf-8").splitlines())
    lines = build(image, project)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _say("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
