"""The loader keeps a tied embedding and LM head as ONE matrix in every dtype, and computes what transformers does."""

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.workers.models.test_exactness import BLOCK_SIZE, hf_model, random_prompt
from workers.demo.tiny import make_tiny_model
from workers.engine.model_runner import ForwardItem, ModelRunner
from workers.models.loader import load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_stays_one_matrix_after_the_dtype_conversion(tmp_path: Path, dtype: torch.dtype) -> None:
    model_dir = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    ours = load_model(model_dir, dtype)
    assert ours.lm_head.weight is ours.embed.weight and ours.embed.weight.dtype == dtype
    hf = hf_model(model_dir)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())  # shared: once
    if dtype is torch.float32:
        prompt = random_prompt(9, seed=0)
        logits = ModelRunner(ours, num_blocks=8, block_size=BLOCK_SIZE).forward(
            [ForwardItem(prompt, 0, [0, 1, 2], num_logits=9)]
        )  # [9, V]
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]  # [9, V]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("make", "role", "reason"),
    [
        (lambda d: d / "nowhere", "target", ": no such directory"),  # transformers read it as a hub repo id
        (lambda d: d, "draft", " has no config.json"),  # ... and this as a slow tokenizer to convert
        (lambda d: (d / "config.json").write_text("{}") and d, "EAGLE head", " has no \\*.safetensors"),
    ],
)
def test_an_engine_names_a_model_directory_it_cannot_load(
    tiny_target: Path, tmp_path: Path, make: Callable[[Path], Path], role: str, reason: str
) -> None:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    bad = make(tmp_path)
    dirs = {"target": tiny_target, "draft": None, "EAGLE head": None} | {role: bad}
    with pytest.raises(ValueError, match=f"^the {role} {re.escape(str(bad))}{reason}"):
        Engine(EngineConfig(num_threads=1), dirs["target"], draft_dir=dirs["draft"], eagle_dir=dirs["EAGLE head"])
