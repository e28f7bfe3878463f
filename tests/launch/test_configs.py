"""Every shipped config is documented and valid at the world size its comments launch it with."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gnmr_dist.train import launch
from tests.integrations.megatron.settings import launch_checks

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = launch.available_configs()


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    """A megatron indexed dataset with LLaMA-2-sized token ids, for ``$DATA_PREFIX``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for part in torch.arange(0, 32000, 7, dtype=torch.int32).chunk(100):
        builder.add_item(part)  # 100 sequences: --split 99,1,0 gives the valid split one
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("model")
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=16)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_the_expected_configs_ship():
    assert {
        "demo_deepspeed.hjson",
        "megatron/demo_cpu.args",
        "deepspeed/llama2_60m_act_quant.hjson",
        "deepspeed/llama2_130m_fp6_fp8.hjson",
        "deepspeed/llama2_130m_nvfp4.hjson",
        "deepspeed/llama2_13b_lora_int8.hjson",
        "megatron/llama2_60m_act_quant.args",
        "megatron/llama2_130m_fp6_fp8.args",
        "megatron/llama2_350m_te_fp8.args",
    } <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_commented_and_valid(name, data_prefix, local_model, monkeypatch, capsys):
    text = (ROOT / "configs" / name).read_text()
    header = re.match(r"((?:#[^\n]*\n)+)", text)
    assert header and len(header.group(1).splitlines()) >= 3, "say what it reproduces"
    world = _launched_world(text)
    env = _set_env(data_prefix)
    if name.endswith(".args"):  # all at once: test_megatron_sets_pass_megatrons_parser
        return
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    extra = ["--init-from", local_model] if "lora" in name else []
    assert launch.main(["check", "--world-size", world, name, *extra]) == 0, capsys.readouterr().err


def _launched_world(text: str) -> str:
    """The world size the config's comments launch it with (2 when they do not say)."""
    launched = re.findall(r"NPROC_PER_NODE=(\d+)", text.split("\n--", 1)[0])
    return str(int(launched[0]) if launched else 2)


def _set_env(data_prefix: str) -> dict[str, str]:
    return {"DATA_PREFIX": data_prefix, "TOKENIZER_MODEL": str(ROOT / "tokenizer.model")}


def test_megatron_sets_pass_megatrons_parser(data_prefix):
    """Every ``configs/megatron/*.args``: ``gnmr-launch check`` at its world size, run from
    outside the repository (Megatron-LM's parse_args + validate_args with the GNMR extras)."""
    names = [n for n in CONFIGS if n.endswith(".args")]
    assert len(names) >= 4
    cases = [
        ["check", "--world-size", _launched_world((ROOT / "configs" / n).read_text()), n]
        for n in names
    ]
    for name, (code, _, err) in zip(
        names, launch_checks(cases, "/", **_set_env(data_prefix)), strict=True
    ):
        assert code == 0, (name, err[-3000:])
