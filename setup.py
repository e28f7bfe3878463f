"""Packaging for gnmr-dist. Tooling lives in pyproject.toml; CI pins in requirements/."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="gnmr-dist",
    version="0.1.0",
    description=(
        "GNMR: a run-time stability controller for low-precision (FP8 / quantized) LLM training, "
        "for DeepSpeed and Megatron-core"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(
        include=["gnmr_dist", "gnmr_dist.*", "megatron_patches", "megatron_patches.*"]
    ),
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "deepspeed": ["deepspeed>=0.16"],
        "megatron": ["megatron-core>=0.16"],
        "hf": ["transformers>=5", "peft>=0.17"],
        "report": ["matplotlib>=3.8", "tqdm"],
        "dev": ["pytest>=8", "pytest-timeout", "hypothesis>=6", "ruff>=0.6", "mypy>=1.10"],
    },
    entry_points={
        "console_scripts": [
            "gnmr-replay=gnmr_dist.cli.replay:main",
            "gnmr-report=gnmr_dist.cli.report:main",
            "gnmr-ds-pretrain=gnmr_dist.cli.ds_pretrain:main",
            "gnmr-megatron-pretrain=gnmr_dist.cli.megatron_pretrain:main",
            "gnmr-launch=gnmr_dist.cli.launch:main",
            "gnmr-prepare-data=gnmr_dist.cli.prepare_data:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
