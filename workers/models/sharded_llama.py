"""One tensor-parallel rank's Llama-family model (see sharding.py for who holds what).

The layers are DecoderLayer's with their row-parallel projections (o, down) followed by an all-reduce: the
rank's partial output is summed over the ranks (in float32 for half-precision weights: see _row_parallel),
then the bias is added once. Everything else (norms, rotary, paged attention over the rank's
own KV heads) is DecoderLayer's own code on fewer heads.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.config import ModelConfig
from workers.models.llama import Attend, DecoderLayer, LlamaModel
from workers.models.rope import apply_rope

# sums a tensor over every rank of the group, in place, and returns it; every rank calls it in the same order
AllReduce = Callable[[torch.Tensor], torch.Tensor]


class ShardedDecoderLayer(DecoderLayer):
    def __init__(self, local_cfg: ModelConfig, all_reduce: AllReduce) -> None:
        super().__init__(local_cfg)
        self.all_reduce = all_reduce

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden] (the same on every rank)
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        attend: Attend,  # this rank's heads over its own paged cache: [T, H/N * D]
    ) -> torch.Tensor:  # [T, hidden] (the same on every rank)
        num_tokens, num_qk_heads = h.shape[0], self.num_heads + self.num_kv_heads
        qkv = F.linear(self.input_norm(h), self.qkv.weight, self.qkv.bias)  # [T, (H + 2 KV) / N * D]
        qkv = qkv.view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)  # [T, (H + 2 KV) / N, D]
        qk = apply_rope(qkv[:, :num_qk_heads], cos, sin)  # [T, (H + KV) / N, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H/N, D], [T, KV/N, D]
        attn = attend(q, k, qkv[:, num_qk_heads:])  # [T, H/N * D]
        h = h + self._row_parallel(attn, self.o_proj)
        gate_up = F.linear(self.post_norm(h), self.gate_up.weight, self.gate_up.bias)  # [T, 2 I/N]
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I/N] each
        return h + self._row_parallel(F.silu(gate) * up, self.down)

    def _row_parallel(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:  # [T, in/N] -> [T, hidden]
        if x.dtype in (torch.float32, torch.float64):
            out = self.all_reduce(F.linear(x, linear.weight))  # [T, hidden]: the ranks' shares summed
            return out if linear.bias is None else out + linear.bias
        # half precision: one rank's product unrounded (bf16 x bf16 is exact in float32), the sum in float32,
        # one rounding at the end, as the unsharded matmul's float32 accumulation rounds once
        partial = F.linear(x.float(), linear.weight.float())  # [T, hidden] float32
        out = self.all_reduce(partial)
        if linear.bias is not None:
            out = out + linear.bias.float()
        return out.to(x.dtype)


class ShardedLlamaModel(LlamaModel):
    """LlamaModel over `local_cfg` (sharding.local_config) with all-reducing layers. Only the rank that
    computes logits (rank 0) keeps an LM head; the others hold an empty one."""

    def __init__(self, local_cfg: ModelConfig, all_reduce: AllReduce, has_head: bool) -> None:
        super().__init__(local_cfg)
        self.layers = nn.ModuleList(ShardedDecoderLayer(local_cfg, all_reduce) for _ in range(local_cfg.num_layers))
        if not has_head:
            self.lm_head = _NoHead(local_cfg.hidden_size)  # type: ignore[assignment]  # never called


class _NoHead(nn.Module):
    """The LM head of a rank that computes no logits: an empty weight [0, hidden]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, hidden_size))


def resident_weight_bytes(model: LlamaModel) -> int:
    """Bytes of the model's weights: every parameter once, the LM head not at all when it is the embedding
    (tied), whether or not the loader kept one tensor for both."""
    params = dict(model.named_parameters())  # shared Parameters appear once
    if model.cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return sum(p.numel() * p.element_size() for p in params.values())
