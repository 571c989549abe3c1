"""Shared, session-scoped fixtures: the tiny checkpoints are written once per run, and transformers'
model over each is loaded once. Helpers live in tests/helpers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from gigadecode.checkpoint import make_checkpoint  # noqa: E402

import helpers  # noqa: E402

os.environ["GIGADECODE_KV_SECRET"] = helpers.KV_SECRET     # servers the tests start inherit it

# The tiny models are far faster single-threaded (op overhead dominates; OpenMP threads spin when the 2
# cores are shared with other jobs: 8x slower measured with 2 threads under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="session")
def tiny_ckpt(ckpt_root) -> Path:
    """The tiny preset, seed 0, MXFP4 experts (directory path)."""
    return make_checkpoint(ckpt_root / "tiny_mxfp4", "tiny", seed=0, experts="mxfp4")


@pytest.fixture(scope="session")
def tiny_ckpt_bf16(ckpt_root) -> Path:
    """The tiny preset, seed 0, dense bf16 experts (directory path)."""
    return make_checkpoint(ckpt_root / "tiny_bf16", "tiny", seed=0, experts="bf16")


@pytest.fixture(scope="session")
def hf_model(tiny_ckpt):
    """transformers' GptOssForCausalLM over `tiny_ckpt`, fp32, eval mode."""
    return helpers.load_hf(str(tiny_ckpt), torch.float32)


@pytest.fixture(scope="session")
def hf_model_bf16(tiny_ckpt_bf16):
    """transformers' GptOssForCausalLM over `tiny_ckpt_bf16`, fp32, eval mode."""
    return helpers.load_hf(str(tiny_ckpt_bf16), torch.float32)


@pytest.fixture(scope="session", params=["mxfp4", "bf16"])
def ckpt_and_hf(request):
    """(checkpoint dir, transformers model) for both expert layouts."""
    if request.param == "mxfp4":
        return request.getfixturevalue("tiny_ckpt"), request.getfixturevalue("hf_model")
    return request.getfixturevalue("tiny_ckpt_bf16"), request.getfixturevalue("hf_model_bf16")
