"""docker/pin_image.py: the constraints that keep the image's torch & co. while adding CI's pins."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "pin_image.py"

_spec = importlib.util.spec_from_file_location("pin_image", SCRIPT)
assert _spec and _spec.loader
pin_image = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pin_image)

# what an NGC image roughly looks like to the script: normalized name -> (name, version)
IMAGE = {
    "torch": ("torch", "2.10.0a0+b4e4ee81d3"),
    "numpy": ("numpy", "1.26.4"),
    "transformer-engine": ("transformer_engine", "2.10.0+769ed778"),
    "nvidia-cudnn-frontend": ("nvidia-cudnn-frontend", "1.16.0"),
    "tqdm": ("tqdm", "4.67.1"),
    "packaging": ("packaging", "25.0"),
}
CI = [("numpy", "2.4.6"), ("tqdm", "4.70.1"), ("hjson", "3.1.0"), ("huggingface_hub", "2.4.0")]


def test_the_images_compiled_stack_is_pinned_exactly_and_ci_pins_only_what_is_new():
    lines = pin_image.build(IMAGE, CI)
    pins = [line for line in lines if not line.startswith("#")]
    assert pins == [
        "numpy==1.26.4",  # the image's numpy (TE & co. are compiled against it), not CI's
        "nvidia-cudnn-frontend==1.16.0",
        "torch==2.10.0a0+b4e4ee81d3",
        "transformer_engine==2.10.0+769ed778",
        "hjson==3.1.0",  # new in the image: CI's version
        "huggingface_hub==2.4.0",
    ]  # tqdm: the image has one, the Dockerfile's explicit tqdm== pin decides; packaging: kept


def test_an_image_without_torch_is_refused():
    with pytest.raises(SystemExit, match="no torch"):
        pin_image.build({"numpy": ("numpy", "2.0")}, CI)


def test_expectations_name_the_missing_or_old_transformer_engine():
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert pin_image.check_expectations(IMAGE, here, 2) == []
    assert pin_image.check_expectations(IMAGE, "2.7", None) == [f"Python {here}, expected 2.7"]
    no_te = {k: v for k, v in IMAGE.items() if k != "transformer-engine"}
    assert "not installed" in pin_image.check_expectations(no_te, None, 2)[0]
    old = {**IMAGE, "transformer-engine": ("transformer_engine", "1.13.0")}
    assert pin_image.check_expectations(old, None, 2) == [
        "Transformer Engine 1.13.0, expected 2.x or later"
    ]


def test_verify_reports_a_replaced_or_removed_torch(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(pin_image.build(IMAGE, CI)) + "\n")
    assert pin_image.verify(path, IMAGE) == []
    swapped = {**IMAGE, "torch": ("torch", "2.13.0")}
    assert pin_image.verify(path, swapped) == ["torch changed from 2.10.0a0+b4e4ee81d3 to 2.13.0"]
    gone = {k: v for k, v in IMAGE.items() if k != "transformer-engine"}
    assert pin_image.verify(path, gone) == ["transformer_engine==2.10.0+769ed778 was removed"]


def test_the_script_runs_against_this_environment(tmp_path):
    out_file = tmp_path / "constraints-image.txt"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    project = ROOT / "requirements" / "constraints-cpu.txt"
    args = ["--project", str(project), "--out", str(out_file), "--expect-python", here]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    import torch

    assert f"torch=={torch.__version__}" in out_file.read_text().splitlines()
    check = [sys.executable, str(SCRIPT), "--verify", str(out_file)]
    assert subprocess.run(check, capture_output=True, timeout=60).returncode == 0
    # the build's own expectation fails loudly on a host without Transformer Engine
    te = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.txt"), "--expect-te-major", "2"]
    bad = subprocess.run(te, capture_output=True, text=True, timeout=60)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        assert bad.returncode == 1 and "Transformer Engine is not installed" in bad.stderr
        assert not (tmp_path / "x.txt").exists()
    else:
        assert bad.returncode == 0
