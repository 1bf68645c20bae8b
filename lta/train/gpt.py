"""A small character-level GPT and the text it trains on: the standard library's pydoc topics.

The text ships with every CPython (``pydoc_data.topics``), so ``lta train`` needs no download. Characters
are mapped to ids by sorted order; the last 10% of the text is held out for validation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GptConfig:
    vocab: int
    context: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4


class CharCorpus:
    """The pydoc topics text as ids; ``batch`` samples random windows of the train or val split."""

    def __init__(self, val_fraction: float = 0.1) -> None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[name] for name in sorted(topics))
        chars = sorted(set(text))
        self.vocab = len(chars)
        lookup = np.zeros(max(map(ord, chars)) + 1, dtype=np.int64)
        lookup[[ord(c) for c in chars]] = np.arange(len(chars))
        ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
        cut = int(len(ids) * (1 - val_fraction))
        self.train = torch.from_numpy(ids[:cut].copy())
        self.val = torch.from_numpy(ids[cut:].copy())

    def batch(
        self, split: str, batch: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
        offsets = torch.arange(context + 1)
        window = data[starts[:, None] + offsets]
        return window[:, :-1], window[:, 1:]


class Block(nn.Module):
    def __init__(self, cfg: GptConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class CharGpt(nn.Module):
    """Decoder-only transformer; the output head shares the token embedding's weights."""

    def __init__(self, cfg: GptConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.layers)))
        self.norm = nn.LayerNorm(cfg.width)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * cfg.layers) if "proj" in name else 1.0))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        logits = self.norm(self.blocks(x)) @ self.tokens.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stacked_losses(
    cfg: GptConfig, params: dict[str, torch.Tensor], ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """:class:`CharGpt`'s loss for N replicas at once, each with its own parameters and batch.

    ``params``: every parameter of ``CharGpt.named_parameters()`` with a leading replica axis (N, *shape);
    ``ids`` and ``targets``: (N, B, T). Returns the N mean losses (N,). Replica w's loss depends only on
    row w of every parameter, so the gradient of ``losses.sum()`` with respect to row w is replica w's own
    gradient: one autograd pass gives the N gradients (lta/train/simulated.py). The same operations as
    ``CharGpt.forward`` with the replica axis folded into batched matrix products and the attention's
    batch; equal to N separate forwards up to float rounding (tests/test_simulated_train.py states the bound).
    """
    n, b, t = ids.shape
    c, heads = cfg.width, cfg.heads
    p = params
    table = p["tokens.weight"]  # (N, V, C)
    vocab = table.shape[1]
    offsets = torch.arange(n, device=ids.device).view(n, 1, 1) * vocab
    x = F.embedding(ids + offsets, table.reshape(n * vocab, c)) + p["positions.weight"][:, None, :t]
    x = x.reshape(n, b * t, c)

    def norm(h: torch.Tensor, name: str) -> torch.Tensor:
        return torch.addcmul(p[f"{name}.bias"][:, None], F.layer_norm(h, (c,)), p[f"{name}.weight"][:, None])

    def linear(h: torch.Tensor, name: str) -> torch.Tensor:
        return torch.baddbmm(p[f"{name}.bias"][:, None], h, p[f"{name}.weight"].transpose(1, 2))

    for i in range(cfg.layers):
        pre = f"blocks.{i}"
        q, k, v = linear(norm(x, f"{pre}.norm1"), f"{pre}.qkv").split(c, dim=2)
        q, k, v = (z.reshape(n * b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + linear(attn.transpose(1, 2).reshape(n, b * t, c), f"{pre}.proj")
        hidden = F.gelu(linear(norm(x, f"{pre}.norm2"), f"{pre}.mlp.0"))
        x = x + linear(hidden, f"{pre}.mlp.2")
    logits = torch.bmm(norm(x, "norm"), table.transpose(1, 2))  # the head shares the token embedding
    losses = F.cross_entropy(logits.reshape(n * b * t, vocab), targets.reshape(-1), reduction="none")
    return losses.view(n, b * t).mean(dim=1)
