"""``gnmr-gpu-check`` on a CPU: its runner, exit status, ``--list``, ``--require``, ``--json``,
argument checks, the flush of each line as its check ends, and the command end to end.

The runner is driven with check functions of its own that pass, fail, skip and crash (no TE is
faked); ``machine=`` stands in for what :func:`gnmr_dist.train.gpu_check.program.detect` finds.
The command itself runs in a subprocess: on this machine it runs ``shadow_casts[cpu]`` and exits
with 5 and one line on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gnmr_dist.train.gpu_check.catalog import catalog
from gnmr_dist.train.gpu_check.program import main
from gnmr_dist.train.gpu_check.runner import (
    EXIT_CODES,
    Check,
    Machine,
    Outcome,
    Skip,
    Status,
    exit_code,
    run_check,
)

ROOT = Path(__file__).resolve().parents[2]
GPU = Machine(cuda=None, te=None, megatron=None, recipes={"tensorwise": None, "mxfp8": "no MX"})
CPU = Machine(cuda="CUDA is not available (no CUDA device)")


def passes(context):
    return Outcome(True, "equal", {"diff": 0.0})


def fails(context):
    return Outcome(False, "max |diff| 0.5")


def skips(context):
    raise Skip("TE 2.14 lacks backward_override")


def crashes(context):
    raise ZeroDivisionError("the check itself is broken")


def returns_none(context):
    return None


def check(name, fn, needs="host", recipes=()):
    return Check(name, needs, f"{name}: what it compares", fn, recipes)


def run(capsys, argv, checks, machine=GPU):
    code = main(argv, checks=checks, machine=machine)
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------ --list


def test_list_names_every_check_on_any_machine(capsys):
    names = [c.name for c in catalog()]
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines()[:-1]]
    assert listed == names and len(set(names)) == len(names) == 40
    recipes = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")
    for family in ("quantizers", "shadow_bound", "fp8_equal"):
        assert all(f"{family}[{r}]" in names for r in recipes)
    for name in (
        "shadow_casts[cpu]",
        "delayed_state[keep]",
        "stronger_recovery[tensorwise->blockwise]",
        "gemm_subset[fprop]",
        "tokens_per_s[small]",
        "tokens_per_s[large]",
        "megatron_gamma[tensorwise]",
    ):
        assert name in names
    first_megatron = next(i for i, c in enumerate(catalog()) if c.needs == "megatron")
    assert all(c.needs == "megatron" for c in catalog()[first_megatron:])  # TE-only first


# ------------------------------------------------------------------------------ exit status


@pytest.mark.parametrize(
    ("fns", "code"),
    [
        ([passes, passes], 0),
        ([passes, fails], 1),
        ([crashes, fails, skips], 1),
        ([passes, crashes], 3),
        ([crashes, skips], 3),
        ([passes, skips], 4),
        ([returns_none], 3),
    ],
)
def test_the_exit_status_tells_a_failure_from_a_crash_from_a_skip(capsys, fns, code):
    checks = [check(f"c{i}", fn) for i, fn in enumerate(fns)]
    got, out, _ = run(capsys, [], checks)
    assert got == code
    assert f"exit {code}: {EXIT_CODES[code]}" in out
    states = ("PASS", "FAIL", "SKIP", "CRASH")
    named = [ln.split()[1] for ln in out.splitlines() if ln.startswith(states)]
    assert named == [f"c{i}" for i in range(len(fns))]  # one line each, none lost


def test_a_crash_is_caught_printed_with_its_frame_and_the_others_still_run(capsys):
    checks = [check("first", crashes), check("second", passes)]
    code, out, _ = run(capsys, [], checks)
    lines = out.splitlines()
    crash = next(i for i, ln in enumerate(lines) if ln.startswith("CRASH"))
    assert "ZeroDivisionError: the check itself is broken" in lines[crash]
    assert "test_gpu_check.py" in lines[crash + 1] and "in crashes" in lines[crash + 1]
    assert any(ln.startswith("PASS") and "second" in ln for ln in lines) and code == 3


def test_what_the_machine_lacks_is_not_run_or_skipped_with_the_reason(capsys):
    checks = [
        check("host", passes),
        check("gpu", passes, "te"),
        check("mx", passes, "te", ("mxfp8",)),
        check("mcore", passes, "megatron"),
    ]
    cpu = run(capsys, [], checks, CPU)
    assert cpu[0] == 5 and cpu[2].count("\n") == 1  # the one-line reason
    assert "cannot run here: CUDA is not available" in cpu[2] and "3 of the checks" in cpu[2]
    no_megatron = Machine(None, None, "megatron-core is not importable", {"mxfp8": "no MX"})
    code, out, _ = run(capsys, [], checks, no_megatron)
    assert code == 4
    assert "SKIP" in out and "no MX" in out and "megatron-core is not importable" in out
    results = [run_check(c, None, no_megatron) for c in checks]
    assert [r.status for r in results] == [Status.PASS, Status.PASS, Status.SKIP, Status.SKIP]
    assert exit_code(results) == 4 and exit_code([*results, run_check(checks[1], None, CPU)]) == 5


# ------------------------------------------------------------------------------ --require


def test_require_makes_a_named_skip_count_and_lets_the_others_skip(capsys):
    checks = [check("a[x]", passes), check("a[y]", passes), check("b", skips)]
    assert run(capsys, ["--require", "a"], checks)[0] == 0  # a family name: both a[...] pass
    assert run(capsys, ["--require", "a[x]", "--require", "b"], checks)[0] == 4
    assert run(capsys, [], checks)[0] == 4
    failing = [*checks, check("c", fails)]
    assert run(capsys, ["--require", "a[x]"], failing)[0] == 1  # a failure always counts
    gpu_only = [check("h", passes), check("g", passes, "te")]
    assert run(capsys, ["--require", "h"], gpu_only, CPU)[0] == 0
    assert run(capsys, ["--require", "g"], gpu_only, CPU)[0] == 5


def test_only_runs_a_subset_and_unknown_names_are_usage_errors(capsys):
    checks = [check("a[x]", fails), check("b", passes)]
    code, out, _ = run(capsys, ["--only", "b"], checks)
    assert code == 0 and "a[x]" not in out
    for argv in (["--only", "nope"], ["--require", "a[z]"], ["--only", "b", "--require", "a"]):
        with pytest.raises(SystemExit) as stop:
            main(argv, checks=checks, machine=GPU)
        assert stop.value.code == 2
        assert "--list names every check" in capsys.readouterr().err


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens", "100"], "not a positive multiple of 128"),
        (["--hidden", "0"], "not a positive multiple of 128"),
        (["--hidden", "wide"], "is not an integer"),
        (["--layers", "0"], "below 1"),
        (["--steps", "3"], "below 4"),
        (["--recipe", "fp8"], "invalid choice"),
        (["--small-limit", "0.5"], "below 1"),
        (["--json", "/nonexistent/folder/out.json"], "does not exist"),
    ],
)
def test_arguments_are_checked_before_anything_runs(capsys, argv, message):
    ran = []
    checks = [check("a", lambda context: ran.append(1) or Outcome(True, ""))]
    with pytest.raises(SystemExit) as stop:
        main(argv, checks=checks, machine=GPU)
    assert stop.value.code == 2 and message in capsys.readouterr().err and not ran


def test_the_sizes_reach_the_checks(capsys):
    seen = []

    def record(context):
        seen.append(context)
        return Outcome(True, "")

    args = ["--hidden", "256", "--layers", "3", "--tokens", "512", "--steps", "5", "--recipe"]
    run(capsys, [*args, "mxfp8", "--large-limit", "1.2"], [check("a", record)])
    (context,) = seen
    assert (context.sizes.hidden, context.sizes.layers, context.sizes.tokens) == (256, 3, 512)
    assert (context.sizes.steps, context.recipe, context.large_limit) == (5, "mxfp8", 1.2)


# ------------------------------------------------------------------------------ --json


def test_json_holds_every_result_and_is_written_after_each_check(capsys, tmp_path):
    path = tmp_path / "out.json"
    seen_mid_run = []

    def reads_the_file(context):
        seen_mid_run.append(json.loads(path.read_text()))
        return Outcome(True, "read it")

    checks = [
        check("a", passes),
        check("b", crashes),
        check("c", reads_the_file),
        check("d", skips),
        check("e", passes, "te", ("mxfp8",)),
    ]
    code, _, _ = run(capsys, ["--json", str(path)], checks)
    (mid,) = seen_mid_run
    assert [c["name"] for c in mid["checks"]] == ["a", "b"] and mid["finished"] is False
    doc = json.loads(path.read_text())
    assert doc["finished"] is True and doc["exit_code"] == code == 3
    assert doc["exit_meaning"] == EXIT_CODES[3] and doc["tool"] == "gnmr-gpu-check"
    by_name = {c["name"]: c for c in doc["checks"]}
    assert [c["status"] for c in doc["checks"]] == ["PASS", "CRASH", "PASS", "SKIP", "SKIP"]
    assert by_name["a"]["data"] == {"diff": 0.0} and by_name["e"]["detail"] == "no MX"
    assert "ZeroDivisionError" in by_name["b"]["traceback"]
    assert by_name["d"]["detail"] == "TE 2.14 lacks backward_override"
    assert doc["summary"] == {
        "passed": 2,
        "failed": 0,
        "skipped": 2,
        "crashed": 1,
        "not run here": 0,
    }
    assert doc["recipes"] == dict(GPU.recipes) and doc["sizes"]["hidden"] == 4096
    assert doc["argv"] == ["--json", str(path)] and "torch" in doc["versions"]
    assert not list(tmp_path.glob("*.tmp"))


# ------------------------------------------------------------------------------ subprocesses

_TWO_CHECKS = textwrap.dedent(
    """
    import pathlib, sys, time
    from gnmr_dist.train.gpu_check.program import main
    from gnmr_dist.train.gpu_check.runner import Check, Machine, Outcome

    go = pathlib.Path(sys.argv[1])

    def first(context):
        return Outcome(True, "first done")

    def second(context):  # ends only once the parent has read the first check's line
        deadline = time.monotonic() + 60
        while not go.exists():
            if time.monotonic() > deadline:
                return Outcome(False, "the first line never reached the parent")
            time.sleep(0.02)
        return Outcome(True, "second done")

    checks = [Check("first", "host", "", first), Check("second", "host", "", second)]
    sys.exit(main([], checks=checks, machine=Machine(cuda=None, te=None)))
    """
)


def _env():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_each_line_is_flushed_as_its_check_ends(tmp_path):
    go = tmp_path / "go"
    cmd = [sys.executable, "-c", _TWO_CHECKS, str(go)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # a pipe: without a flush the line would wait in a buffer
        lines.append(line)
        if line.startswith("PASS") and "first" in line:
            go.touch()
    assert proc.wait(timeout=120) == 0, lines
    assert [ln.split()[1] for ln in lines if ln.startswith("PASS")] == ["first", "second"]


def test_the_command_on_a_cpu_runs_the_host_check_and_exits_5_with_one_line(tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gnmr_dist.cli.gpu_check", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 5, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gnmr-gpu-check: cannot run")
    assert "PASS   shadow_casts[cpu]" in done.stdout and "Traceback" not in done.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    statuses = {c["status"] for c in doc["checks"][1:]}
    assert doc["checks"][0]["status"] == "PASS" and statuses == {"NOT-RUN"}
    assert time.monotonic() - start < 120
