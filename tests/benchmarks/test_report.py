"""benchmarks/report: RESULTS.md is what the result files render through its template, its verdict
words follow the intervals, and every section shows the provenance its result files record.

The first test is the guard: a result file changed (or RESULTS.md edited by hand) without running
``python -m benchmarks.report`` fails it. The others render a copy of the result files with one
figure changed, to show that the figure and the words that depend on it move together.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.harness import provenance
from benchmarks.harness.branch_stats import verdict
from benchmarks.report import DOCUMENT, main, render
from benchmarks.report.faults import FaultRegime
from benchmarks.report.source import RESULTS, Source
from benchmarks.report.words import paragraph, resolved


def test_results_md_is_what_the_result_files_render():
    assert main(["--check"]) == 0, "run `python -m benchmarks.report` and commit RESULTS.md"


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """The committed result files without the trunk checkpoints; plots as empty files (the
    document only links them)."""
    root = tmp_path / "results"
    for src in RESULTS.rglob("*"):
        rel = src.relative_to(RESULTS)
        if src.is_dir() or rel.parts[0] == "sweep" or src.suffix == ".pt":
            continue
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".png":
            dst.touch()
        else:
            shutil.copyfile(src, dst)
    return root


def _flat(root: Path) -> str:
    """The rendered document with its lines joined (prose is filled to 100 columns)."""
    return " ".join(render(root).split())


def _edit(root: Path, name: str, edit) -> None:
    path = root / f"{name}.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_copy_renders_the_committed_document(results):
    assert render(results) == DOCUMENT.read_text()


def test_a_changed_interval_changes_its_figure_and_its_verdict(results, tmp_path):
    before = _flat(results)
    key = "GNMR+e 4 - NVIDIA last-4"
    assert f"| {key} | +0.0002 +- 0.0004 | -0.0011 +- 0.0016 |" in before
    assert "GNMR+e buys back 54% +- 32% of NVFP4's cost, the same as NVIDIA's" in before

    def better(d):
        d["comparisons"][key] = [-0.0030, 0.0010]

    _edit(results, "sweep_fp4_nvfp4", better)
    after = _flat(results)
    assert f"| {key} | -0.0030 +- 0.0010 **better** |" in after
    assert "GNMR+e buys back 54% +- 32% of NVFP4's cost, more than NVIDIA's" in after
    out = tmp_path / "RESULTS.md"
    out.write_text(DOCUMENT.read_text())
    assert main(["--check", "--results", str(results), "--out", str(out)]) == 1


def test_a_selection_verdict_follows_its_gap_and_its_bar(results):
    """A static gap is resolved (quality is measurable) when its interval excludes 0;
    selection is yes when GNMR+e 3's risk reaches the bar in every fault window, partly in some."""
    row = "| `act_quant` | 200, 3 | +0.002 +- 0.076 | none | none | 0.82 +- 0.06 | **yes** |"
    assert row in _flat(results)
    assert "| `delayed` | 150, 3 | +0.032 +- 0.047 | none | none | 0.69 +- 0.05; 0.74 +- 0.16;" in (
        _flat(results)
    )

    def wider(d):
        d["static_gap"] = [0.1, 0.05]

    def missed(d):
        d["summary"]["GNMR+e 3"]["selection_fault"]["90-97"]["risk_topk"]["precision_grad"][0] = 0.5

    _edit(results, "sweep_act_quant", wider)
    _edit(results, "sweep_delayed", missed)
    text = _flat(results)
    assert row.replace("+0.002 +- 0.076", "+0.100 +- 0.050 **resolved**") in text
    assert "0.74 +- 0.16; 0.50 +- 0.33 | **partly** |" in text


def test_a_stored_step_time_run_becomes_a_table(results):
    """The file ``python -m benchmarks.sweep.branches --step-time`` appends to (its writer:
    ``test_branch.py``)."""
    (results / "sweep_fp4_step_time_nvfp4.json").unlink(missing_ok=True)
    assert "No run is stored" in _flat(results)
    ms = {"NVIDIA last-4": 600.0, "GNMR+e 4": 606.0, "GNMR+e 4 replayed": 600.0}
    run = {"date": "2026-12-03", "seed": 1234, "point": 175, "steps": 40, "warmup": 5, "ms": ms}
    runs = [{**run, "vs_nvidia": 1.01, "vs_replayed": 1.01}] * 2
    stored = {"regime": "nvfp4", "target": 1.02, "runs": runs}
    (results / "sweep_fp4_step_time_nvfp4.json").write_text(json.dumps(stored))
    text = _flat(results)
    assert "No run is stored" not in text
    assert "| 2 | 2026-12-03 |" in text and "606.0 ms" in text
    assert "**1.010 and 1.010, within the 1.02 target**" in text
    assert (
        "`sweep_fp4_step_time_nvfp4.json` | `python -m benchmarks.sweep.branches --step-time"
        in text
    )


@pytest.mark.parametrize(
    ("pair", "word"),
    [
        ((-0.3, 0.1), "better"),
        ((0.3, 0.1), "worse"),
        ((0.05, 0.1), "not resolved"),
        ((0.1, 0.1), "not resolved"),
    ],
)
def test_verdict_words_come_from_the_interval(pair, word):
    assert verdict(pair) == word
    assert resolved(pair) == (word != "not resolved")


def test_prose_never_starts_a_line_with_a_list_marker():
    text = paragraph("x" * 97 + " - y " + "+- z " * 40)
    assert all(not line.startswith(("- ", "+- ")) for line in text.splitlines())
    assert all(len(line) <= 100 for line in text.splitlines()[:-1])


def test_a_result_file_shows_the_provenance_it_records(results, monkeypatch):
    """A record made now names the commit, the versions and the host, and the document shows
    them beside the file; a file without one says so."""
    record = provenance.record()
    assert set(record) == {"commit", "commit_source", "dirty", "versions", "host"}
    assert set(record["versions"]) == {"python", "torch", "megatron-core", "deepspeed"}
    assert record["host"]["threads"] >= 1 and record["host"]["isa"]

    def stamped(d):
        d["provenance"] = {**record, "commit": "0123456789abcdef", "dirty": True}

    _edit(results, "overhead_error", stamped)
    text = _flat(results)
    head = "| 1 | 0123456789 (1): git rev-parse HEAD (run), with uncommitted changes; versions"
    assert head in text
    assert f"torch {record['versions']['torch']}" in text
    assert f"ISA {record['host']['isa']}, {record['host']['threads']} torch threads" in text

    def unstamped(d):
        d.pop("provenance", None)

    _edit(results, "overhead", unstamped)
    row = (
        "| `overhead.json` | `python -m benchmarks.overhead` | 1 | not recorded (1): no provenance"
    )
    assert row in _flat(results)


# -- the fault regimes' section (benchmarks/report/faults.py), on constructed records ----------

FAULT_SEEDS = (1, 2, 3, 4)
FAULT_POINTS = (100, 350)


def constructed_arms(high: str, more: dict[str, tuple[float, float]]) -> dict:
    """The constructed regimes' arms: arm -> (held-out minus the recovery arm ``high``'s,
    recovered work): the statics, both nulls, NVIDIA's rule, random selection and GNMR+e at 4 of
    28 units, then ``more``."""
    arms = {"low-cost": (0.010, 0.0), high: (0.0, 1.0), f"null {high} (1e-6)": (0.0, 1.0)}
    arms |= {"null low-cost (1e-6)": (0.010, 0.0), "NVIDIA last-4": (0.009, 4 / 28)}
    return arms | {"random 4": (0.008, 4 / 28), "GNMR+e 4": (0.004, 4 / 28)} | more


FAULT_ARMS = constructed_arms(
    "BF16", {"GNMR+e v2 4": (0.004, 4 / 28), "TE autoswitch 4": (0.006, 4 / 28)}
)


def _fault_record(arm: str, seed: int, point: int, offset: float, share: float) -> dict:
    """A branch record as :mod:`benchmarks.sweep.branches` writes it, with a held-out loss of the
    seed's base plus ``offset`` (the BF16 trunk progresses 0.05 nats from step 25 to 50) plus a
    small per-seed wobble for the nulls and the budgeted arms."""
    base = 2.5 - point / 1e4 + 0.01 * seed
    wobble = {"GNMR+e v2 4": 2e-4 * (-1) ** seed, "null BF16 (1e-6)": 1e-5 * (-1) ** seed}
    wobble["null low-cost (1e-6)"] = wobble["null BF16 (1e-6)"]
    if arm in ("NVIDIA last-4", "random 4", "GNMR+e 4", "TE autoswitch 4"):
        wobble[arm] = 3e-4 * ((seed * 7 + len(arm)) % 3 - 1)
    h = base + offset + wobble.get(arm, 0.0)
    layer = seed % 4
    units = [0] * 28
    units[layer * 7 + 6] = round(share * 1400)  # all on the faulted down_proj
    spec = {"backend": "fp8_emulated", "low_cost": {"format": "e2m1"}, "recovery": {}}
    spec["recovery"] = {"format": "bf16"}
    outlier = {"module": f"model.layers.{layer}.mlp.down_proj", "channel": 3 + seed}
    outlier |= {"start": point + 5, "rise": 10, "hold": 25, "growth": 4.0}
    return branch_record(arm, seed, point, h, units, share) | {
        "outliers": [outlier],
        "arm_spec": spec,
    }


def branch_record(arm: str, seed: int, point: int, h: float, units: list[int], share: float):
    """The fields every constructed branch record shares: held-out ``h`` at 50 steps (the trunk
    progresses 0.05 nats from step 25), per-unit recovered steps ``units`` of 28 x 50, the FLOP
    share ``share``, no outlier, a test provenance."""
    return {
        "arm": arm,
        "seed": seed,
        "point": point,
        "heldout": {"25": h + 0.05, "50": h},
        "train_loss": [2.0] * 50,
        "recovered_unit_steps": sum(units),
        "unit_recovered": units,
        "unit_steps": 1400,
        "flops_recovered": share,
        "nonfinite": 0,
        "outliers": [],
        "provenance": {"commit": "0123456789abcdef", "commit_source": "test"},
    }


def _fault_records(arms=FAULT_ARMS, seeds=FAULT_SEEDS, points=FAULT_POINTS) -> list[dict]:
    return [_fault_record(a, s, p, *arms[a]) for s in seeds for p in points for a in arms]


def _write(root: Path, family: str, name: str, records: list[dict]) -> None:
    """``records`` as the JSON-lines file ``<root>/<family>/<name>.jsonl``."""
    path = root / family / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _section(root: Path, module: str) -> str:
    """The section of ``benchmarks.report.<module>`` alone, rendered from ``root`` and filled as
    in the document, lines joined."""
    import importlib

    from benchmarks.report import environment
    from benchmarks.report.source import Source
    from benchmarks.report.words import fill_document

    src = Source(root)
    names = importlib.import_module(f"benchmarks.report.{module}").context(src)
    text = environment().get_template(f"{module}.md.j2").render(src=src, **names)
    return " ".join(fill_document(text).split())


def _write_faults(root: Path, records: list[dict], name: str = "outlier_test") -> None:
    _write(root, "faults", name, records)


def _fault_section(root: Path) -> str:
    return _section(root, "faults")


def _keyed(rows: list[dict]) -> dict:
    return {(r["arm"], r["seed"], r["point"]): r for r in rows}


def test_fault_regime_tables_and_preregistered_words(tmp_path):
    _write_faults(tmp_path, _fault_records())
    text = _fault_section(tmp_path)
    assert "### outlier_test" in text
    design = "4 seeds x 2 branch points (100 and 350), 50-step branches, 9 arms, every branch"
    assert f"**Design: {design} recorded.**" in text
    assert "it struck, by seed: L1.down c4 (1), L2.down c5 (2), L3.down c6 (3)" in text
    assert "Noise bar: the static gap +0.0100 +- 0.0000, resolved;" in text
    assert "null low-cost +0.0000 +- 0.0000, reach 0.00: **passes**." in text
    row = "| outlier_test | GNMR+e 4 - random 4 | -0.0040 | 0.0000 | better | 4 of 4 (p = 0.125) |"
    assert row in text
    assert "| outlier_test | GNMR+e v2 4 - GNMR+e 4 | +0.0001 | 0.0011 | not resolved |" in text
    # the arms table: work, vs BF16, share, diverged, on the faulted unit, then the cost cells
    arm = "| GNMR+e 4 | 14.3% | +0.0039 +- 0.0005 | +0.61 +- 0.05 | 0 | 100.0% | - | 2.0 +- 0.2 |"
    assert arm in text
    assert "speed-up, B200 |" in text and "n/a (no FP4 GEMMs)" in text
    assert "| `faults/outlier_test.jsonl` | 72 | 0123456789 (72): test;" in text
    regime = FaultRegime(Source(tmp_path), "outlier_test")
    with pytest.raises(KeyError, match="no column 'recoverd work'"):  # misspelt: refused, not blank
        regime.columns(["recoverd work"])

    rows = _fault_records({**FAULT_ARMS, "random 4": (0.002, 4 / 28)})
    _write_faults(tmp_path, rows)
    assert "| outlier_test | GNMR+e 4 - random 4 | +0.0020 |" in _fault_section(tmp_path)
    assert "| 0.0000 | worse | 0 of 4 (p = 0.125) |" in _fault_section(tmp_path)


def test_a_fault_regime_in_progress_names_what_is_missing(tmp_path):
    rows = _fault_records()
    rows = [r for r in rows if not (r["arm"] == "TE autoswitch 4" and r["seed"] > 2)]
    rows = [r for r in rows if not (r["arm"] == "GNMR+e v2 4" and r["seed"] > 1)]
    _write_faults(tmp_path, rows)
    text = _fault_section(tmp_path)
    assert "**Design: 2 seeds x 2 branch points" in text
    assert "Not every arm has every seed: TE autoswitch 4: 2 of 4 seeds at these points;" in text
    assert "waiting, with too few seeds for an interval: GNMR+e v2 4;" in text
    assert "| GNMR+e v2 4 - GNMR+e 4 | - | - | waiting for GNMR+e v2 4 |" in text


def test_a_host_other_than_the_bf16_branch_is_set_aside(tmp_path):
    """Seed 2's random 4 at point 100 ran on another CPU: it is counted, not paired."""
    rows = _fault_records()
    host = {"cpu": "AMD EPYC", "isa": "AVX512", "threads": 1, "cores": 2}
    for r in rows:
        r["provenance"]["host"] = dict(host)
        if (r["arm"], r["seed"], r["point"]) == ("random 4", 2, 100):
            r["provenance"]["host"]["cpu"] = "Intel Xeon"
    _write_faults(tmp_path, rows)
    text = _fault_section(tmp_path)
    assert "**Set aside: 1 records** (random 4) at 1 (seed, point), trained on Intel Xeon" in text
    assert "**Design: 3 seeds x 2 branch points" in text  # random 4 lacks seed 2 there
    assert "| outlier_test | GNMR+e 4 - NVIDIA last-4 |" in text


def test_the_arms_order_is_total():
    """Arms sharing a prefix (the late rules) sort by name: no set's iteration order (string
    hashes differ between processes) reaches the document."""
    from itertools import permutations

    from benchmarks.report.branches import rank

    arms = ["NVIDIA late-57", "NVIDIA late fwd (82%)", "late fwd (same work)", "TE autoswitch"]
    orders = {tuple(sorted(p, key=rank)) for p in permutations(arms)}
    assert len(orders) == 1


def test_a_power_run_widens_only_the_comparisons_it_serves(tmp_path):
    """Seeds 5 and 6 carry the statics, GNMR+e 4 and random 4 only: the design (every arm)
    stays on 4 seeds, GNMR+e 4 - random 4 pairs over 6, the others over the design's 4."""
    rows = _fault_records()
    power = ("low-cost", "BF16", "GNMR+e 4", "random 4")
    rows += _fault_records({a: FAULT_ARMS[a] for a in power}, seeds=(5, 6))
    _write_faults(tmp_path, rows)
    text = _fault_section(tmp_path)
    assert "**Design: 4 seeds x 2 branch points" in text
    line = text.split("| GNMR+e 4 - random 4 |")[1].split("| outlier_test |")[0]
    assert "| better |" in line and line.rstrip().endswith("| 6 |"), line
    line = text.split("| GNMR+e 4 - NVIDIA last-4 |")[1].split("| outlier_test |")[0]
    assert line.rstrip().endswith("| 4 |"), line


def test_the_late_rules_are_judged_where_they_act(tmp_path):
    rows = _fault_records()
    for s in FAULT_SEEDS:  # late-57: the low-cost path at 100, the recovery path at 350
        rows.append(_fault_record("NVIDIA late-57", s, 100, 0.010, 0.0))
        rows.append(_fault_record("NVIDIA late-57", s, 350, 0.001, 1.0))
    _write_faults(tmp_path, rows)
    text = _fault_section(tmp_path)
    assert "NVIDIA late-57 runs the low-cost path throughout at 100 and recovers 100% of" in text
    assert "the work at 350; at point 350 (4 seeds, 95%): GNMR+e 4 - NVIDIA late-57 +0.0029" in text


def test_the_loss_oracle_has_its_own_grid(tmp_path):
    rows = _fault_records()
    for u in range(28):  # seed 1, point 100: the faulted unit (L1.down, 13) gains most
        gain = 0.005 if u == 13 else 0.001 * (u % 3)
        rows.append(_fault_record(f"single {u}", 1, 100, 0.010 - gain, 1 / 28))
    for s in (1, 2):
        rows.append(_fault_record("loss oracle 4", s, 100, 0.003, 4 / 28))
    _write_faults(tmp_path, rows)
    text = _fault_section(tmp_path)
    assert "**Design: 4 seeds x 2 branch points" in text  # not cut to 2
    assert "on 2 seeds (1 and 2) x 1 branch points (100): loss oracle 4 closes +0.70" in text
    assert "GNMR+e 4 - loss oracle 4 +0.00" in text
    assert "the largest single gain of the 28 units on 1 of 1 branches" in text
    assert "(its rank and gain by seed: 1st +0.0050 (1))" in text


def test_the_fault_constants_match_the_harness():
    """The report reads these without importing the harness's torch modules."""
    from benchmarks.harness import designs
    from benchmarks.harness.branch import NULL_ARMS, Instrument
    from benchmarks.harness.model import PROJECTIONS
    from benchmarks.report import branches, faults
    from benchmarks.sweep.regimes import FAULT_REGIMES

    assert designs.PROJECTIONS == PROJECTIONS
    assert set(NULL_ARMS) <= set(branches.nulls("BF16"))
    assert {r.family for r in FAULT_REGIMES.values()} == {faults.FAMILY}
    assert {r.instrument.trunk_steps for r in FAULT_REGIMES.values()} == {branches.SCHEDULE_END}
    assert (
        branches.SCHEDULE_END - Instrument().horizon
        in FAULT_REGIMES["outlier_nvfp4"].instrument.points
    )


def test_the_report_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, benchmarks.report; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_the_fp4_section_prices_every_arm_and_judges_its_noise(results):
    text = _flat(results)
    fp4 = text.split("## FP4")[1].split("## Fault regimes")[0]
    assert "(Hopper n/a (no FP4 GEMMs); priced on the unit-step share" in fp4
    assert "| arm | recovered work | held-out - BF16 | share of the gap closed |" in fp4
    assert "speed-up, B200 | speed-up, GB300 |" in fp4 and "| speed-up, B200, GB300 |" in fp4
    assert "| GNMR+e 4 | 13.3% | +0.0014 +- 0.0014 | +0.54 +- 0.32 | 0 | 1.2 +- 0.4 | 2.78" in fp4
    assert (
        "| GNMR+e | +0.29 +- 0.12 (6.5%) | +0.35 +- 0.13 (12.9%) | +0.50 +- 0.10 (22.5%) |" in fp4
    )
    # SR seed 1 reaches 1.24 of NVFP4's gap: the bar fails; the stress's nulls stay under 1/3
    assert "(SR seed 1) +0.0015 +- 0.0022 (reach 1.24): the noise bar does not pass" in fp4
    assert "low-cost +0.0051 +- 0.0175 (reach 0.20): the noise bar passes" in fp4


# -- the top paragraph (benchmarks/report/summary.py) ---------------------------------------------


def _summary(root: Path) -> str:
    from benchmarks.report import environment, summary
    from benchmarks.report.source import Source
    from benchmarks.report.words import fill_document

    src = Source(root)
    text = environment().get_template("summary.md.j2").render(src=src, **summary.context(src))
    return " ".join(fill_document(text).split())


def test_the_top_paragraph_says_where_gnmr_pays_and_where_it_does_not(tmp_path):
    """A passing fault regime gets a row of the table with GNMR+e's share, verdicts and reading;
    one swept on 5 seeds whose gap holds 0 is 'nothing to recover'; one with 2 seeds a pilot."""
    seeds5 = (1, 2, 3, 4, 5)
    _write_faults(tmp_path, _fault_records(seeds=seeds5), "outlier_pays")
    flat = {a: (0.0, w) for a, (_, w) in FAULT_ARMS.items()}
    rows = _fault_records(flat, seeds=seeds5)
    for r in rows:  # a gap of either sign per seed: not resolved
        if r["arm"] == "low-cost":
            r["heldout"]["50"] += 0.002 * (-1) ** r["seed"]
    _write_faults(tmp_path, rows, "outlier_absorbed")
    _write_faults(tmp_path, _fault_records(seeds=(1, 2)), "outlier_pilot")
    text = _summary(tmp_path)
    row = "| `outlier_pays` | 5 (up to 5) | +0.0100 +- 0.0000 | 61% +- 3% | 14.3% |"
    assert row in text
    assert "GNMR+e 4 vs random 4: -0.0040 +- 0.0000 better (5);" in text
    assert "GNMR+e v2 4 vs GNMR+e 4: +0.0000 +- 0.0007 not resolved (5)" in text
    assert "| 2.69 +- 0.01 / 3.64 +- 0.00 | GNMR+e v2 4 | **turn it on** |" in text
    assert "Where the format absorbs the fault (`outlier_absorbed`: the static gap is" in text
    assert "Piloted on two seeds only, not yet a verdict: `outlier_pilot`" in text
    tie = {"random 4": (0.004, 4 / 28), "NVIDIA last-4": (0.004, 4 / 28)}
    rows = _fault_records({**FAULT_ARMS, **tie}, seeds=seeds5)
    _write_faults(tmp_path, rows, "outlier_pays")
    assert "| it helps; its margin over the fixed rules is not resolved |" in _summary(tmp_path)
    _write_faults(
        tmp_path,
        _fault_records({**FAULT_ARMS, **tie, "random 4": (0.002, 4 / 28)}, seeds=seeds5),
        "outlier_pays",
    )
    assert "| a fixed rule does better |" in _summary(tmp_path)
    rows = _fault_records({**FAULT_ARMS, "GNMR+e 4": (0.010, 4 / 28)}, seeds=seeds5)
    _write_faults(tmp_path, rows, "outlier_pays")
    text = _summary(tmp_path)
    assert "| 1% +- 3% |" in text and "| it does not help here |" in text


def test_what_the_verdicts_rest_on_is_a_table_per_regime():
    """The committed records: the standing units, the covered seeds, the margins without them,
    the old cost model and the stopping history, one column per regime; the bounded cost is the
    fault section's arms table."""
    document = render()
    text = " ".join(document.split("## FP4")[0].split())
    assert "| | `outlier_delayed` | `outlier_fp8_tensor` | `outlier_torchao_tensorwise` |" in text
    assert "| L0.v 48, L0.o 49, L0.down 48 |" in text
    assert "| 6 of 20: 42, 29, 31, 37, 43, 67 (69%) |" in text
    assert "vs random 4 -0.0182 +- 0.0117 better, 14 of 14 below (p = 0.00012)" in text
    assert "| 14.5% = 7.8% + 2.9% + 3.7% + 0.1% |" in text
    assert "2^20 (2^10: +0.0004 +- 0.0114, 2 seeds x 2 points)" in text
    assert "| 436, past the schedule's end; 1.16 -> 0.80 (75.5 steps) |" in text
    assert "20 of 20 below random 4 (p = 1.9e-06, 2.3e-05)" in text
    # the bounded cost model: the arms table of outlier_delayed (low-cost, GNMR+e 4, the null)
    faults = " ".join(document.split("### outlier_delayed\n")[1].split("###")[0].split())
    assert "| low-cost | 0.0% | +0.0748 +- 0.0576 |" in faults
    assert "| - | - | not reached on 11 of 40 | 10 of 10 |" in faults
    gnmr = "| +5.0% (every step) | 0.1 +- 0.2 | 8 of 10 | by 50: 20, not by 50: 30 | 1.67 +- 0.01 |"
    assert gnmr in faults
    assert "| 3.6% | - | -0.0 +- 0.0 | 4 of 10 |" in faults  # the BF16 null, behind at the end
