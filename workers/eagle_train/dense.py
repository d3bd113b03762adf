"""Our Llama-family model run densely over equal-length rows (no paged cache): greedy continuations and
features for training data, and causal attention for training the head.

Every row of a batch has the same length, so nothing is padded: the flat [B * T] tokens the model code
expects are B rows of T back to back, and attention views them as [B, T].
"""

import torch
import torch.nn.functional as F

from workers.models.llama import Attend, LlamaModel


def causal_attend(batch: int, num_heads: int, scale: float) -> Attend:
    """Causal self-attention within each of `batch` equal rows (training and full-row feature passes)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # [B*T, H|KV, D] -> [B*T, H*D]
        q4, k4, v4 = (x.view(batch, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
        out = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1]
        )  # [B, H, T, D]
        return out.transpose(1, 2).reshape(q.shape[0], -1)

    return attend


class _DenseCache:
    """A per-layer [B, max_len, KV, D] cache that attention appends to (greedy generation)."""

    def __init__(self, model: LlamaModel, batch: int, max_len: int) -> None:
        cfg = model.cfg
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        dtype = model.embed.weight.dtype
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in model.layers]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in model.layers]
        self.batch, self.scale, self.num_heads = batch, model.attn_scale, cfg.num_heads
        self.length = 0  # tokens already cached per row

    def attends(self, num_new: int) -> list[Attend]:
        return [self._attend(i, num_new) for i in range(len(self.keys))]

    def _attend(self, layer: int, num_new: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            start, end = self.length, self.length + num_new
            self.keys[layer][:, start:end] = k.view(self.batch, num_new, *k.shape[1:])
            self.values[layer][:, start:end] = v.view(self.batch, num_new, *v.shape[1:])
            q4 = q.view(self.batch, num_new, *q.shape[1:]).transpose(1, 2)  # [B, H, n, D]
            k4 = self.keys[layer][:, :end].transpose(1, 2)  # [B, KV, end, D]
            v4 = self.values[layer][:, :end].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q4, k4, v4, is_causal=num_new > 1, scale=self.scale, enable_gqa=self.num_heads != k.shape[1]
            )  # [B, H, n, D]; a prefill (start 0) is causal, one new token sees every key
            return out.transpose(1, 2).reshape(q.shape[0], -1)

        return attend


@torch.inference_mode()
def greedy_continuations(
    model: LlamaModel, prompts: torch.Tensor, num_new: int
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, P + num_new - 1] long, [B, P + num_new - 1, hidden])
    """Each prompt row ([B, P] long) continued greedily, with the features of every token fed: the rows hold
    the prompt and the first num_new - 1 greedy tokens (the last one is drawn but never fed, so it has no
    feature and is not returned)."""
    batch, prompt_len = prompts.shape
    cache = _DenseCache(model, batch, prompt_len + num_new)
    rows, feats = [], []
    tokens = prompts
    for _ in range(num_new):
        n = tokens.shape[1]
        positions = torch.arange(cache.length, cache.length + n).repeat(batch)  # [B * n]
        h = model.hidden_states(tokens.reshape(-1), positions, cache.attends(n)).view(batch, n, -1)  # [B, n, hidden]
        cache.length += n
        rows.append(tokens)
        feats.append(h)
        tokens = model.lm_head(model.norm(h[:, -1])).argmax(dim=-1, keepdim=True)  # [B, 1]
    return torch.cat(rows, dim=1), torch.cat(feats, dim=1)


@torch.inference_mode()
def features(model: LlamaModel, rows: torch.Tensor) -> torch.Tensor:
    """rows [B, T] long -> [B, T, hidden]: the last layer's output before the final norm (the head's feature)."""
    batch, length = rows.shape
    attends = [causal_attend(batch, model.cfg.num_heads, model.attn_scale) for _ in model.layers]
    positions = torch.arange(length).repeat(batch)  # [B * T]
    return model.hidden_states(rows.reshape(-1), positions, attends).view(batch, length, -1)
