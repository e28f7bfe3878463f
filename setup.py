"""Packaging for gnmr-dist. Tooling lives in pyproject.toml; CI pins in requirements/."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

HF = ["transformers>=5", "peft>=0.17", "accelerate>=1.0"]
"""Hugging Face Trainer, peft and accelerate (GNMRCallback, the LoRA example)."""
REPORT = ["matplotlib>=3.8", "tqdm"]
"""gnmr-report's figure and the programs' progress bar."""
MEGATRON = [
    'megatron-core>=0.17; python_version >= "3.12"',
    'megatron-core>=0.16,<0.17; python_version < "3.12"',
]
"""megatron-core: 0.17+ (with Megatron-LM's training loop) on Python 3.12+, where it installs;
on 3.11 pip resolves 0.16.1 (megatron_patches on your own loop; gnmr-megatron-pretrain says how
to get 0.17.1 there)."""
MEGATRON_LM = ["pyyaml", "psutil", "tensorboard", "sentencepiece"]
"""What Megatron-LM's loop (megatron.training) imports beyond megatron-core's own dependencies,
which megatron-core lists only in an extra with much GNMR's route never imports: pyyaml
(megatron.training.initialize), psutil (the checkpoint writer, at the first --save),
tensorboard (--tensorboard-dir) and sentencepiece (the LLaMA tokenizer), both used by the shipped
argument sets. gnmr_dist.integrations.megatron.loop.TRAINING_NEEDS is the table the program checks
at start; tests/integrations/megatron/test_requirements.py checks this list against it and it
against megatron's sources."""

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
    packages=[
        *find_packages(
            include=["gnmr_dist", "gnmr_dist.*", "megatron_patches", "megatron_patches.*"]
        ),
        "gnmr_dist.configs",
    ],
    # configs/ (the launchable DeepSpeed configs and Megatron argument sets) ships inside the
    # package, where gnmr-launch finds it in an installed wheel
    package_dir={"gnmr_dist.configs": "configs"},
    package_data={"gnmr_dist.configs": ["*.hjson", "*.json", "*/*.hjson", "*/*.json", "*/*.args"]},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        # each program's extra holds everything it imports
        "deepspeed": ["deepspeed>=0.16", "hjson", *HF, *REPORT],  # gnmr-ds-pretrain, gnmr-launch
        "megatron": [*MEGATRON, *MEGATRON_LM, *REPORT],  # gnmr-megatron-pretrain (0.17+)
        "hf": [*HF, "deepspeed>=0.16", "hjson"],  # GNMRCallback under Trainer with DeepSpeed
        "report": REPORT,  # gnmr-report
        "torchao": ["torchao>=0.18"],  # the torchao_fp8 backend (torchao's float8 training)
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
            "gnmr-gpu-check=gnmr_dist.cli.gpu_check:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
