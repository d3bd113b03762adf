"""Tiny random-weight checkpoints (HF layout, workers/demo/tiny.py), built once per test run: the target +
draft pair, one model per supported layout, and a one-layer target with its EAGLE heads."""

import platform
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from workers.models.native_attention import NativeAttention

LAYOUTS = ("llama", "qwen2", "mistral")


def cpu_flags() -> set[str]:
    path = Path("/proc/cpuinfo")
    return set(path.read_text().split()) if path.exists() else set()


# the native library's AVX2 build as a build of its own where the host has AVX-512 (elsewhere it is the host's)
HAS_SEPARATE_AVX2_BUILD = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "avx512f"} <= cpu_flags()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): tiny random-weight checkpoints sharing one tokenizer, made once per session."""
    from workers.demo.tiny import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def tiny_target(tiny_pair: tuple[Path, Path]) -> Path:
    """The tiny pair's target alone."""
    return tiny_pair[0]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per layout: {"llama": dir, "qwen2": dir, "mistral": dir}."""
    from workers.demo.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {
        layout: make_tiny_model(root / layout, model_type=layout, seed=i) for i, layout in enumerate(LAYOUTS)
    }


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache (EngineConfig.compile_cache_dir) for the run's compiled engines: a model compiled
    again hits it, and a cached graph must never bring another model's frozen weights."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def eagle_models(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ONE-layer tiny target (its own checkpoint, the tiny pair's tokenizer); a draft agreeing with it
    (perturbed copy); EAGLE heads for it: copy_head agrees most of the time (workers/demo/tiny.py),
    random_head hardly ever; vocab_head is copy_head drafting only the even token ids (a draft vocabulary)."""
    from workers.demo.tiny import (
        TINY_VOCAB,
        make_copy_head,
        make_perturbed_copy,
        make_random_head,
        make_tiny_model,
    )

    root = tmp_path_factory.mktemp("eagle-models")
    target = make_tiny_model(root / "target", num_layers=1, seed=3, tokenizer_from=tiny_pair[0])
    return {
        "target": target,
        "close_draft": make_perturbed_copy(target, root / "close", noise_std=0.005),
        "copy_head": make_copy_head(target, root / "copy-head"),
        "vocab_head": make_copy_head(target, root / "vocab-head", draft_vocab=list(range(0, TINY_VOCAB, 2))),
        "random_head": make_random_head(target, root / "random-head"),
    }


@pytest.fixture(scope="session")
def native_kernel(tmp_path_factory: pytest.TempPathFactory) -> "NativeAttention":
    """The native attention kernel (workers/models/native_attention.py), built once per run with the host's
    compiler: CI machines have gcc, so a missing kernel is a failure here, not a skip."""
    from workers.models.native_attention import load

    kernel = load(tmp_path_factory.mktemp("native-kernel"))
    assert kernel is not None, "the native attention kernel did not build (see the log)"
    return kernel


@pytest.fixture(scope="session")
def avx2_kernel(tmp_path_factory: pytest.TempPathFactory) -> "NativeAttention":
    """The native library built without AVX-512 (on an AVX-512 host: HAS_SEPARATE_AVX2_BUILD): float32 products
    in the register blocks sized for AVX2's 16 vector registers (linear_avx2), 16-lane vectors as two halves."""
    from workers.models.native_attention import load

    kernel = load(tmp_path_factory.mktemp("avx2-kernel"), ("-mno-avx512f",))
    assert kernel is not None, "the native kernel did not build without AVX-512 (see the log)"
    return kernel
