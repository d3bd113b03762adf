"""Tiny random-weight models in HF layout (seconds to make) for tests where only exactness matters.

`make_tiny_model` writes one checkpoint of a given layout (llama, qwen2, mistral) with its tokenizer;
`make_tiny_pair` writes a target and a much smaller draft sharing one tokenizer.
"""

import sysconfig
from pathlib import Path

TINY_VOCAB = 512
EOS = "<|endoftext|>"


def training_texts() -> list[str]:
    """The few stdlib sources the tiny tokenizer is trained on (also a tiny corpus for tiny EAGLE heads)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in ("bisect.py", "heapq.py", "textwrap.py")]


def make_tiny_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with a 512-token vocabulary, saved in HF layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(out_dir))


def make_tiny_model(
    out_dir: Path,
    model_type: str = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 512,
    tokenizer_from: Path | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight checkpoint; weights drawn wider than usual so argmax gaps are clear."""
    import shutil

    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        make_tiny_tokenizer(out_dir)
    else:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, out_dir / f.name)
    eos_id = transformers.AutoTokenizer.from_pretrained(str(out_dir)).convert_tokens_to_ids(EOS)
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    extra: dict = {"sliding_window": None} if model_type in ("mistral", "qwen2") else {}
    config = config_cls(**common, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(out_dir))
    return out_dir


def make_tiny_pair(out_dir: Path) -> tuple[Path, Path]:
    """A 2-layer/64 target and a 1-layer/32 draft sharing one tokenizer; returns (target_dir, draft_dir)."""
    target = make_tiny_model(out_dir / "target", num_layers=2, hidden_size=64, seed=0)
    draft = make_tiny_model(
        out_dir / "draft", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1, tokenizer_from=target
    )
    return target, draft


def make_perturbed_copy(src: Path, out_dir: Path, noise_std: float, seed: int = 0, poison: bool = False) -> Path:
    """A copy of `src` with Gaussian noise on every weight: a draft that agrees with `src` only partly.

    poison=True fills the embedding with NaN instead: a broken draft, for fallback tests.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out_dir / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if poison and "embed" in name:
                tensors[name] = torch.full_like(t, float("nan"))
            elif not poison:
                tensors[name] = t + noise_std * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        save_file(tensors, str(out_dir / f.name), metadata={"format": "pt"})
    return out_dir


def make_random_head(target_dir: Path, out_dir: Path, seed: int = 0, std: float = 0.2) -> Path:
    """A random-weight EAGLE head for the checkpoint in `target_dir` (exactness holds for any head)."""
    import torch

    from workers.models.eagle_head import EagleHead, HeadConfig, save_head
    from workers.models.loader import load_model

    target = load_model(target_dir, torch.float32)
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target.cfg, {"recipe": "random", "seed": seed}), target)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)
            else:  # norm weights 1, biases 0
                param.fill_(1.0 if "norm" in name else 0.0)
    save_head(head, out_dir)
    return out_dir


def make_copy_head(target_dir: Path, out_dir: Path, draft_vocab: list[int] | None = None) -> Path:
    """For a ONE-layer target: a head that nearly is the target. fc passes the next token's embedding through
    and the head's layer is the target's layer, so head row t computes the target's row t + 1 except that it
    never sees token 0: its drafts agree with the target most of the time (deep acceptance in tests).
    `draft_vocab`: the only target token ids it drafts (ascending), or every token for None."""
    import torch

    from workers.models.eagle_head import EagleHead, HeadConfig, save_head
    from workers.models.loader import load_model

    target = load_model(target_dir, torch.float32)
    if target.cfg.num_layers != 1:
        raise ValueError(f"a copy head needs a one-layer target, not {target.cfg.num_layers} layers")
    cfg = HeadConfig.for_target(
        target.cfg, {"recipe": "copy of the target's layer"}, draft_vocab_size=len(draft_vocab or [])
    )
    head = EagleHead(cfg, target)
    hidden = target.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1))  # [H, 2H]
        head.fc.bias.zero_()
        head.layer.load_state_dict(target.layers[0].state_dict())
    if draft_vocab is not None:
        head.set_draft_vocab(torch.tensor(draft_vocab))
    save_head(head, out_dir)
    return out_dir
