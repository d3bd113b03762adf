"""Training one model of the demo pair: a `transformers` Llama trained from scratch on a token stream.

Deterministic by construction: the weights are initialised from `init_seed` and the batches drawn from
`data_seed` alone, the step count is fixed (never a time budget), and the caller pins torch's thread
count (`pinned_threads`).
"""

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)

OnStep = Callable[[int, float], None]  # (step index, training loss) after each optimiser step


@dataclass(frozen=True)
class ModelRecipe:
    """Architecture and training schedule of one model; part of the pair's versioned recipe."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    num_steps: int
    learning_rate: float
    warmup_steps: int
    batch_size: int = 16
    seq_len: int = 128
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1  # the cosine decays to this fraction of `learning_rate`
    grad_clip_norm: float = 1.0
    autocast_bf16: bool = False  # bf16 autocast: faster only where the CPU has bf16 matmul kernels

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if not 0 <= self.warmup_steps < self.num_steps:
            raise ValueError(f"need 0 <= warmup_steps < num_steps, got {self.warmup_steps}, {self.num_steps}")


def llama_config(
    recipe: ModelRecipe, vocab_size: int, eos_token_id: int, max_position_embeddings: int
) -> LlamaConfig:
    """The `LlamaConfig` of a recipe: tied embeddings, no GQA, fp32 weights."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
    )


def lr_factor(step: int, recipe: ModelRecipe) -> float:
    """Linear warmup to 1, then cosine decay to `min_lr_ratio` at the last step."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.num_steps - 1 - recipe.warmup_steps)
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def sample_batch(token_ids: torch.Tensor, recipe: ModelRecipe, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows of `seq_len + 1` tokens from the stream.  # [batch, seq + 1]"""
    num_starts = token_ids.numel() - recipe.seq_len - 1
    starts = torch.randint(0, num_starts, (recipe.batch_size, 1), generator=generator)  # [batch, 1]
    return token_ids[starts + torch.arange(recipe.seq_len + 1)]  # [batch, seq + 1]


def next_token_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting `windows[:, 1:]` from `windows[:, :-1]`."""
    logits = model(input_ids=windows[:, :-1]).logits  # [batch, seq, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def new_model(config: LlamaConfig, init_seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama; the weights depend on `init_seed` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return LlamaForCausalLM(config)


def train_steps(
    model: LlamaForCausalLM,
    recipe: ModelRecipe,
    token_ids: torch.Tensor,
    generator: torch.Generator,
    on_step: OnStep | None = None,
) -> None:
    """`recipe.num_steps` AdamW steps (warmup + cosine) on batches drawn from `generator`.  # [num_tokens]"""
    model.train()
    decay = [p for name, p in model.named_parameters() if p.ndim >= 2 and "embed" not in name]
    no_decay = [p for name, p in model.named_parameters() if p.ndim < 2 or "embed" in name]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, recipe))
    for step in range(recipe.num_steps):
        windows = sample_batch(token_ids, recipe, generator)  # [batch, seq + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.autocast_bf16):
            loss = next_token_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip_norm)
        optimizer.step()
        scheduler.step()
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()


def grow_depth(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A deeper copy of `model` that computes exactly the same function (depth up-scaling).

    Each layer i becomes `factor` consecutive layers: the original, then copies of it whose output
    projections (attention `o_proj`, MLP `down_proj`) are zero, so each copy adds nothing to the residual
    stream until training moves those weights (a SOLAR-style depth up-scale that starts loss-free).
    """
    old_num_layers = model.config.num_hidden_layers
    if num_layers % old_num_layers:
        raise ValueError(f"num_layers {num_layers} is not a multiple of {old_num_layers}")
    factor = num_layers // old_num_layers
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    grown = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".layers." not in name:
            state[name] = tensor.clone()
            continue
        prefix, rest = name.split(".layers.")
        index, leaf = rest.split(".", 1)
        for copy_index in range(factor):
            weight = tensor.clone()
            if copy_index > 0 and leaf in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                weight.zero_()
            state[f"{prefix}.layers.{int(index) * factor + copy_index}.{leaf}"] = weight
    missing, unexpected = grown.load_state_dict(state, strict=False)
    if unexpected or any(name != "lm_head.weight" for name in missing):  # the head is tied to the embedding
        raise RuntimeError(f"depth growth lost weights: missing {missing}, unexpected {unexpected}")
    grown.tie_weights()
    grown.eval()
    return grown


@torch.inference_mode()
def eval_loss(model: LlamaForCausalLM, token_ids: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over up to `max_windows` consecutive, non-overlapping windows of `token_ids`."""
    num_windows = min(max_windows, (token_ids.numel() - 1) // (seq_len + 1))
    if num_windows == 0:
        raise ValueError(f"need more than {seq_len + 1} tokens to evaluate, got {token_ids.numel()}")
    windows = token_ids[: num_windows * (seq_len + 1)].view(num_windows, seq_len + 1)  # [windows, seq + 1]
    losses = [next_token_loss(model, batch).item() for batch in windows.split(16)]
    sizes = [len(batch) for batch in windows.split(16)]
    return sum(loss * size for loss, size in zip(losses, sizes, strict=True)) / num_windows
