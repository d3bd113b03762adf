"""An EAGLE-style draft head: one decoder layer over the target's features, the target's norm and LM head.

Row t of the head reads the target's feature f_t (its last decoder layer's output, before the final norm) and
the embedding of token t + 1; it sits at rotary position t and KV slot t of the head's own one-layer paged
cache, and its output h_t predicts the target's feature f_{t+1}, so norm + LM head of h_t give the logits of
token t + 2. Drafting further feeds h_t back as the feature of the next row (EAGLE-1). The embedding, final
norm and LM head are the target's own, frozen; the head trains fc and its layer only.

A draft vocabulary (EAGLE-3) restricts the head's logits to the target's `draft_vocab_size` most frequent output
tokens: the LM head's product then reads only those rows (a copy of them, `draft_lm_head`), and every other
token gets logit -inf, so the head never drafts it. Verification is unchanged: a drafted token is accepted
against the target's own distribution, so the output stays the target's exactly; a token outside the draft
vocabulary ends a chain where the target takes it (and a sampled one comes from the residual distribution).

Checkpoint: a directory with `config.json` (HEAD_FORMAT, the target it was trained for, the feature layer
ids, the layer's shape, the draft vocabulary's size) and `model.safetensors` (fc.* and layer.* in this module's
names, and `draft_vocab`, the target token ids of the draft vocabulary, where it has one). A head that does
not match its target is refused at load (HeadMismatchError names what differs).
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from workers.models.config import ModelConfig
from workers.models.llama import Attend, DecoderLayer, LlamaModel
from workers.models.packed_linear import Linear, linear

HEAD_FORMAT = "specfleet-eagle-head-v1"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_KEY = "draft_vocab"  # [draft_vocab_size] int64 target ids, ascending (absent: the whole vocabulary)


class HeadMismatchError(ValueError):
    """The head was trained for another target (hidden size, vocabulary, depth or feature layers differ)."""


@dataclass(frozen=True)
class HeadConfig:
    """What a head records about itself and its target (config.json)."""

    hidden_size: int  # the target's
    vocab_size: int  # the target's
    target_num_layers: int
    feature_layer_ids: tuple[int, ...]  # target layers whose outputs form the feature; EAGLE-1: (last,)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    draft_vocab_size: int = 0  # tokens the head may draft (EAGLE-3); 0 = the target's whole vocabulary
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # the recipe and figures, informative

    @classmethod
    def for_target(
        cls, target: ModelConfig, training: dict[str, Any] | None = None, draft_vocab_size: int = 0
    ) -> "HeadConfig":
        """A head shaped like one of the target's layers, reading its last layer (EAGLE-1)."""
        return cls(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            target_num_layers=target.num_layers,
            feature_layer_ids=(target.num_layers - 1,),
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            draft_vocab_size=draft_vocab_size,
            training=training or {},
        )

    def check_target(self, target: ModelConfig) -> None:
        """Raise HeadMismatchError naming every field that differs from `target`."""
        wrong = [
            f"{name}: head {mine}, target {theirs}"
            for name, mine, theirs in (
                ("hidden_size", self.hidden_size, target.hidden_size),
                ("vocab_size", self.vocab_size, target.vocab_size),
                ("num_layers", self.target_num_layers, target.num_layers),
            )
            if mine != theirs
        ]
        if self.feature_layer_ids != (target.num_layers - 1,):
            wrong.append(
                f"feature_layer_ids: head {list(self.feature_layer_ids)}, supported [{target.num_layers - 1}] "
                "(the target's last layer)"
            )
        if not 0 <= self.draft_vocab_size <= target.vocab_size:
            wrong.append(f"draft_vocab_size: head {self.draft_vocab_size}, target vocabulary {target.vocab_size}")
        if wrong:
            raise HeadMismatchError("EAGLE head does not match its target: " + "; ".join(wrong))

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The head's decoder layer as a ModelConfig (the target's rotary settings, the head's shape)."""
        return dataclasses.replace(
            target,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": HEAD_FORMAT, **dataclasses.asdict(self), "feature_layer_ids": list(self.feature_layer_ids)}

    @classmethod
    def from_dir(cls, head_dir: Path) -> "HeadConfig":
        path = head_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{head_dir}: no config.json (not an EAGLE head directory)")
        raw = json.loads(path.read_text())
        if raw.get("format") != HEAD_FORMAT:
            raise HeadMismatchError(f"{head_dir}: format {raw.get('format')!r}, expected {HEAD_FORMAT!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in fields}
        values["feature_layer_ids"] = tuple(values["feature_layer_ids"])
        return cls(**values)


class EagleHead(nn.Module):
    """fc(concat(feature, next-token embedding)) -> one decoder layer; the target's frozen norm and LM head."""

    def __init__(self, cfg: HeadConfig, target: LlamaModel) -> None:
        super().__init__()
        cfg.check_target(target.cfg)
        self.cfg = cfg
        self.layer_cfg = cfg.layer_config(target.cfg)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = DecoderLayer(self.layer_cfg)
        self.attn_scale = cfg.head_dim**-0.5
        self._target = [target]  # a list: the target's modules are shared, not this module's parameters
        self.draft_vocab: torch.Tensor | None = None  # [Vd] long target token ids, ascending; None = all
        self.draft_lm_head: Linear | None = None  # the target's LM head rows of draft_vocab (a copy)

    @property
    def target(self) -> LlamaModel:
        return self._target[0]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """fc.* and layer.*: what a checkpoint holds (the target's parts, and the copy of its LM head rows that
        a draft vocabulary reads, are not saved)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("draft_lm_head.")}

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Draft only `token_ids` ([Vd] distinct target ids, ascending), or every token for None. Raises
        HeadMismatchError for ids the target does not have, repeated or unordered ids, or a count that differs
        from the config's draft_vocab_size."""
        if token_ids is None:
            if self.cfg.draft_vocab_size:
                raise HeadMismatchError(
                    f"config.json names a draft vocabulary of {self.cfg.draft_vocab_size} tokens, "
                    f"but the weights hold no {DRAFT_VOCAB_KEY!r}"
                )
            self.draft_vocab, self.draft_lm_head = None, None
            return
        weight = self.target.lm_head.weight  # [V, hidden]
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        vocab_size = self.cfg.vocab_size
        if ids.dim() != 1 or ids.numel() != self.cfg.draft_vocab_size:
            raise HeadMismatchError(
                f"draft vocabulary: {list(ids.shape)} ids, "
                f"config.json's draft_vocab_size is {self.cfg.draft_vocab_size}"
            )
        if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise HeadMismatchError(
                f"draft vocabulary: ids must be distinct, ascending and in [0, {vocab_size}) (the target's)"
            )
        self.draft_lm_head = Linear(
            self.cfg.hidden_size, ids.numel(), bias=False, dtype=weight.dtype, device=weight.device
        )
        with torch.no_grad():
            self.draft_lm_head.weight.copy_(weight[ids])  # [Vd, hidden]
        self.draft_lm_head.requires_grad_(False)
        self.draft_vocab = ids

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    def hidden(
        self,
        input_ids: torch.Tensor,  # [T] long: token t + 1 of each row
        features: torch.Tensor,  # [T, hidden]: the target's feature f_t (or the head's own h_{t-1})
        positions: torch.Tensor,  # [T] long: t
        attend: Attend,
    ) -> torch.Tensor:  # [T, hidden]: h_t, the head's prediction of f_{t+1}
        target = self.target
        x = self.layer_input(input_ids, features)  # [T, hidden]
        cos, sin = target.cos_table[positions], target.sin_table[positions]  # [T, D] each
        return self.layer(x, cos, sin, attend)

    def layer_input(
        self,
        input_ids: torch.Tensor,  # [T] long: token t + 1 of each row
        features: torch.Tensor,  # [T, hidden]
    ) -> torch.Tensor:  # [T, hidden]: fc over [feature, next-token embedding], the layer's input
        return linear(self.fc_input(input_ids, features), self.fc)

    def fc_input(
        self,
        input_ids: torch.Tensor,  # [T] long: token t + 1 of each row
        features: torch.Tensor,  # [T, hidden]
    ) -> torch.Tensor:  # [T, 2 hidden]: [feature, next-token embedding], what fc reads
        embedded = torch.embedding(self.target.embed.weight, input_ids)  # [T, hidden] (the module's call: ~5 us more)
        return torch.cat([features.to(self.fc.weight.dtype), embedded], dim=-1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V] float32
        """The target's norm and LM head over h; with a draft vocabulary, its rows only and -inf elsewhere."""
        target = self.target
        head = target.lm_head if self.draft_lm_head is None else self.draft_lm_head
        return self.widen(linear(target.norm(h), head).float())

    def head_weight(self) -> torch.Tensor:  # [V or Vd, hidden]
        """The LM head's weight the logits use: the draft vocabulary's rows, or the target's whole head."""
        return (self.target.lm_head if self.draft_lm_head is None else self.draft_lm_head).weight

    def widen(self, drafted: torch.Tensor) -> torch.Tensor:  # [S, Vd] float32 -> [S, V]
        """Logits over the head's outputs as logits over the target's vocabulary (-inf outside a draft one)."""
        if self.draft_vocab is None:
            return drafted
        out = drafted.new_full((drafted.shape[0], self.cfg.vocab_size), float("-inf"))  # [S, V]
        return out.index_copy_(1, self.draft_vocab, drafted)


def save_head(head: EagleHead, out_dir: Path) -> None:
    """config.json + model.safetensors (float32) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in head.trainable_state().items()}
    if head.draft_vocab is not None:
        state[DRAFT_VOCAB_KEY] = head.draft_vocab.contiguous()
    save_file(state, str(out_dir / WEIGHTS_FILE))
    (out_dir / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2, sort_keys=True) + "\n")


def load_head(head_dir: str | Path, target: LlamaModel) -> EagleHead:
    """The head in `head_dir` over `target` (in the target's dtype), for inference. Raises HeadMismatchError."""
    head_dir = Path(head_dir)
    cfg = HeadConfig.from_dir(head_dir)
    cfg.check_target(target.cfg)
    head = EagleHead(cfg, target)
    state = load_file(str(head_dir / WEIGHTS_FILE))
    draft_vocab = state.pop(DRAFT_VOCAB_KEY, None)
    head.load_state_dict(state, strict=True)
    weight = target.embed.weight
    head = head.to(dtype=weight.dtype, device=weight.device).eval().requires_grad_(False)
    head.set_draft_vocab(draft_vocab)
    return head
