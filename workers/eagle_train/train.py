"""Self-distillation of an EAGLE head from its target.

Data: `num_sequences` windows of `prompt_len` corpus tokens (seeded draws), each continued greedily by the
target for `gen_len` tokens in batches of equal-length rows; then the target's features of every row.
Loss per head row t (reads f_t and token t + 1): cross-entropy against the target's own next-token
distribution at t + 1 (softmax of its logits, computed from f_{t+1} through the frozen norm and LM head) plus
`feature_weight` x smooth-L1 between the head's output and f_{t+1}. The training-time test (`ttt_steps`
extra passes): the head reads its own previous pass's outputs as features (row t gets h_{t-1}), so it
learns to draft from its own guesses as it does past the first token; pass i weighs `ttt_decay`**i.

The draft vocabulary (`draft_vocab_size` > 0, EAGLE-3): the target's most frequent tokens among its own
continuations (ties to the lower id), kept with the head; the head is trained over the whole vocabulary and
drafts only those (workers/models/eagle_head.py).

Deterministic for a fixed recipe: a fixed step count (never a time budget), seeded draws and init, pinned
torch threads.
"""

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from workers.eagle_train.dense import causal_attend, greedy_continuations
from workers.models.eagle_head import EagleHead, HeadConfig, save_head
from workers.models.llama import LlamaModel
from workers.models.loader import load_model, load_tokenizer
from workers.models.threads import pinned_threads

TRAINING_RECORD = "training.json"  # the figures of a training run (times, last losses), beside the head


@dataclass(frozen=True)
class EagleRecipe:
    """Everything that determines a head's bytes (with the target, the corpus, the code and torch)."""

    num_sequences: int = 1024  # training rows: corpus windows continued by the target
    prompt_len: int = 32  # corpus tokens per window
    gen_len: int = 64  # greedy target tokens after each window
    gen_batch_size: int = 256  # rows generated at once
    num_steps: int = 200
    batch_size: int = 16  # rows per step
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    feature_weight: float = 0.5  # smooth-L1 feature regression next to the distribution loss
    ttt_steps: int = 1  # training-time test: extra passes on the head's own features
    ttt_decay: float = 0.7
    draft_vocab_size: int = 0  # > 0: the head drafts only the target's this many most frequent output tokens
    seed: int = 0
    num_threads: int = 1  # one thread: on a shared 2-core host a 2nd thread mostly waits (NOTES-CPU)

    def __post_init__(self) -> None:
        if min(self.num_sequences, self.prompt_len, self.gen_len, self.num_steps, self.batch_size) < 1:
            raise ValueError(f"sizes and steps must be >= 1: {self}")
        if self.ttt_steps < 0 or self.warmup_steps < 0 or self.draft_vocab_size < 0:
            raise ValueError(f"ttt_steps, warmup_steps and draft_vocab_size must be >= 0: {self}")


def corpus_windows(token_ids: torch.Tensor, recipe: EagleRecipe) -> torch.Tensor:  # [N] -> [num_sequences, P]
    """Seeded windows of `prompt_len` consecutive tokens of the corpus."""
    if token_ids.numel() <= recipe.prompt_len:
        raise ValueError(f"the corpus has {token_ids.numel()} tokens; need more than prompt_len={recipe.prompt_len}")
    generator = torch.Generator().manual_seed(recipe.seed)
    starts = torch.randint(0, token_ids.numel() - recipe.prompt_len, (recipe.num_sequences,), generator=generator)
    return token_ids[starts.unsqueeze(1) + torch.arange(recipe.prompt_len)]  # [num_sequences, P]


def make_training_rows(
    target: LlamaModel, windows: torch.Tensor, recipe: EagleRecipe, progress: tqdm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, L] long rows, [N, L, hidden] float32 features), L = P + gen - 1
    """The target's greedy continuation of every window, and its features over each whole row."""
    rows, feats = [], []
    for start in range(0, windows.shape[0], recipe.gen_batch_size):
        batch_rows, batch_feats = greedy_continuations(
            target, windows[start : start + recipe.gen_batch_size], recipe.gen_len
        )
        rows.append(batch_rows)
        feats.append(batch_feats.float())
        if progress is not None:
            progress.update(batch_rows.shape[0])
    return torch.cat(rows), torch.cat(feats)


def most_frequent_outputs(
    rows: torch.Tensor,  # [N, L] long: prompt windows and the target's continuations
    prompt_len: int,
    vocab_size: int,
    draft_vocab_size: int,
) -> torch.Tensor:  # [draft_vocab_size] long, ascending
    """The draft vocabulary: the `draft_vocab_size` tokens the target generated most often in `rows` (after each
    row's prompt), ties and tokens it never generated in id order."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in [1, {vocab_size}] (the target's vocabulary), got {draft_vocab_size}"
        )
    counts = torch.bincount(rows[:, prompt_len:].reshape(-1), minlength=vocab_size)  # [V]
    by_count = torch.argsort(-counts, stable=True)  # [V]: most generated first, equal counts by id
    return by_count[:draft_vocab_size].sort().values


def lr_factor(step: int, recipe: EagleRecipe) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.num_steps - 1 - recipe.warmup_steps)
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def head_loss(
    head: EagleHead,
    rows: torch.Tensor,  # [B, L] long
    feats: torch.Tensor,  # [B, L, hidden] the target's features
    recipe: EagleRecipe,
) -> tuple[torch.Tensor, dict[str, float]]:  # (scalar loss, figures of the first pass)
    batch, length = rows.shape
    hidden_size = feats.shape[-1]
    tokens = rows[:, 1:].reshape(-1)  # [B * (L-1)]: token t + 1 of head row t
    positions = torch.arange(length - 1).repeat(batch)  # [B * (L-1)]
    # rows whose predicted token (t + 2) the target generated: the loss's rows; every row is context
    first = max(0, min(recipe.prompt_len - 2, length - 2))
    next_feats = feats[:, first + 1 :]  # [B, R, hidden]: f_{t+1} of the loss rows
    with torch.no_grad():
        p_target = head.logits(next_feats.reshape(-1, hidden_size)).softmax(dim=-1)  # [B * R, V]
    inputs = feats[:, :-1].reshape(-1, hidden_size)  # [B * (L-1), hidden]: f_t
    attend = causal_attend(batch, head.cfg.num_heads, head.attn_scale)
    total = torch.zeros(())
    figures: dict[str, float] = {}
    for i in range(1 + recipe.ttt_steps):
        h = head.hidden(tokens, inputs, positions, attend)  # [B * (L-1), hidden]
        h_loss = h.view(batch, length - 1, hidden_size)[:, first:]  # [B, R, hidden]
        log_q = F.log_softmax(head.logits(h_loss.reshape(-1, hidden_size)), dim=-1)  # [B * R, V]
        ce = -(p_target * log_q).sum(dim=-1).mean()  # cross-entropy against the target's p
        feature_loss = F.smooth_l1_loss(h_loss, next_feats)
        total = total + recipe.ttt_decay**i * (ce + recipe.feature_weight * feature_loss)
        if i == 0:
            agree = (log_q.argmax(-1) == p_target.argmax(-1)).float().mean()
            figures = {"ce": ce.item(), "feature": feature_loss.item(), "top1": agree.item()}
        # next pass: row t reads the head's own guess of f_t (row t-1's output); row 0 keeps the true f_0
        guesses = h.view(batch, length - 1, -1)  # [B, L-1, hidden]
        inputs = torch.cat([feats[:, :1], guesses[:, :-1]], dim=1).reshape(-1, feats.shape[-1])
    return total, figures


def train_head(
    target: LlamaModel,
    rows: torch.Tensor,  # [N, L] long
    feats: torch.Tensor,  # [N, L, hidden]
    recipe: EagleRecipe,
    progress: tqdm | None = None,
) -> tuple[EagleHead, dict[str, float]]:
    """A new head trained for recipe.num_steps steps; returns it and its last step's figures."""
    torch.manual_seed(recipe.seed)
    head = EagleHead(HeadConfig.for_target(target.cfg), target).float()
    head.train()
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay, betas=(0.9, 0.95)
    )
    generator = torch.Generator().manual_seed(recipe.seed + 1)
    figures: dict[str, float] = {}
    for step in range(recipe.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate * lr_factor(step, recipe)
        picks = torch.randint(0, rows.shape[0], (recipe.batch_size,), generator=generator)  # [B]
        loss, figures = head_loss(head, rows[picks], feats[picks], recipe)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"top1 {figures['top1']:.2f} ce {figures['ce']:.2f}", refresh=False)
    head.eval()
    return head, figures


def train_eagle(
    target_dir: Path, texts: list[str], out_dir: Path, recipe: EagleRecipe, show_progress: bool = True
) -> dict[str, Any]:
    """Train a head for the checkpoint in `target_dir` on `texts` and save it into `out_dir`; returns its
    training record (also in the head's config.json, under `training`)."""
    start_s = time.perf_counter()
    with pinned_threads(recipe.num_threads):
        target = load_model(target_dir, torch.float32)
        if recipe.draft_vocab_size > target.cfg.vocab_size:
            raise ValueError(
                f"draft_vocab_size {recipe.draft_vocab_size} is larger than the target's vocabulary "
                f"({target.cfg.vocab_size})"
            )
        tokenizer = load_tokenizer(target_dir)
        tokenizer.model_max_length = 2**62  # whole documents are encoded; windows are cut from them below
        eos = target.cfg.eos_token_ids[:1]
        token_ids = torch.tensor(
            [t for text in texts for t in [*tokenizer.encode(text, add_special_tokens=False), *eos]], dtype=torch.long
        )  # [N]
        windows = corpus_windows(token_ids, recipe)  # [num_sequences, P]
        with tqdm(total=recipe.num_sequences, desc="eagle data", unit="row", file=sys.stderr,
                  disable=not show_progress, dynamic_ncols=True) as progress:  # fmt: skip
            rows, feats = make_training_rows(target, windows, recipe, progress)
        data_time_s = time.perf_counter() - start_s
        with tqdm(total=recipe.num_steps, desc="eagle head", unit="step", file=sys.stderr,
                  disable=not show_progress, dynamic_ncols=True) as progress:  # fmt: skip
            head, figures = train_head(target, rows, feats, recipe, progress)
        if recipe.draft_vocab_size:
            draft_vocab = most_frequent_outputs(rows, recipe.prompt_len, target.cfg.vocab_size, recipe.draft_vocab_size)
            head.cfg = dataclasses.replace(head.cfg, draft_vocab_size=recipe.draft_vocab_size)
            head.set_draft_vocab(draft_vocab)
            coverage = float(torch.isin(rows[:, recipe.prompt_len :], draft_vocab).float().mean())
    # config.json records what determines the bytes; timings go to training.json beside it
    recipe_record = {
        "recipe": dataclasses.asdict(recipe),
        "num_trainable_params": sum(v.numel() for v in head.trainable_state().values()),  # not the LM head rows
        "num_corpus_tokens": int(token_ids.numel()),
        "torch": torch.__version__,
    }
    record: dict[str, Any] = {
        **recipe_record,
        "data_time_s": round(data_time_s, 1),
        "train_time_s": round(time.perf_counter() - start_s - data_time_s, 1),
        "last_step": {k: round(v, 4) for k, v in figures.items()},
    }
    if recipe.draft_vocab_size:  # the share of the target's training continuations the head can draft
        record["draft_vocab_coverage"] = round(coverage, 4)
    head.cfg = dataclasses.replace(head.cfg, training=recipe_record)
    save_head(head, out_dir)
    (out_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record
