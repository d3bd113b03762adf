"""The `specfleet generate` command-line contract, run as a real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli", *args], capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_generate_json_contract(tiny_models: dict[str, Path]) -> None:
    proc = run_cli(
        "generate", "def parse(argv):", "--target", str(tiny_models["llama"]), "--max-tokens", "12", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) >= {"text", "token_ids", "finish_reason", "metrics"}
    assert len(doc["token_ids"]) == 12 and doc["finish_reason"] == "length"
    assert doc["metrics"]["tokens_per_s"] > 0


def test_generate_streams_text_and_prints_stats(tiny_models: dict[str, Path]) -> None:
    proc = run_cli("generate", "import os", "--target", str(tiny_models["qwen2"]), "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "8 tokens in" in proc.stderr and "tok/s" in proc.stderr


def test_generate_rejects_bad_input_with_a_reason(tiny_models: dict[str, Path]) -> None:
    proc = run_cli("generate", "x", "--target", str(tiny_models["llama"]), "--top-p", "0")
    assert proc.returncode == 2
    assert "top_p" in proc.stderr


def test_generate_with_an_eagle_head(eagle_models: dict[str, Path]) -> None:
    target, head = str(eagle_models["target"]), str(eagle_models["copy_head"])
    # a fixed k: the tiny head costs what its tiny target does, so measured lengths would draft nothing
    proc = run_cli("generate", "def parse(argv):", "--target", target, "--eagle", head, "--speculative", "eagle",
                   "--max-tokens", "16", "--json", env={"SPECFLEET_ENGINE_IS_ADAPTIVE": "false"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    plain = json.loads(run_cli("generate", "def parse(argv):", "--target", target, "--speculative", "none",
                               "--max-tokens", "16", "--json").stdout)  # fmt: skip
    assert doc["token_ids"] == plain["token_ids"] and doc["metrics"]["mean_accepted_tokens"] > 1.0


def test_generate_refuses_eagle_without_a_head(tiny_models: dict[str, Path]) -> None:
    proc = run_cli("generate", "x", "--target", str(tiny_models["llama"]), "--speculative", "eagle")
    assert proc.returncode == 2 and "no EAGLE head" in proc.stderr


def test_generate_refuses_a_device_it_cannot_use_with_a_reason(tiny_models: dict[str, Path]) -> None:
    proc = run_cli("generate", "x", "--target", str(tiny_models["llama"]), "--device", "gpu")
    assert proc.returncode == 2 and "device" in proc.stderr and "Traceback" not in proc.stderr
    if not torch.cuda.is_available():
        proc = run_cli("generate", "x", "--target", str(tiny_models["llama"]), "--device", "cuda")
        assert proc.returncode == 2 and "sees no CUDA device" in proc.stderr
    proc = run_cli("generate", "x", "--target", str(tiny_models["llama"]), "--device", "cpu", "--max-tokens", "4")
    assert proc.returncode == 0, proc.stderr
