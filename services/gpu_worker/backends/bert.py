"""A BERT encoder in plain torch, loading Hugging Face `BertModel` checkpoints (safetensors).

Written here rather than imported from `transformers` so the worker's hot path is a handful of
fused ops (scaled-dot-product attention) with no framework dispatch around them, and so the
worker does not depend on `transformers` at run time. Parameter names mirror Hugging Face's,
so `load_state_dict` maps the checkpoint one to one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        # RoBERTa and XLM-R checkpoints hold BERT's fields and weight names, and loaded as
        # BERT: their positions start after the padding index, so every embedding came out
        # wrong without a word (review finding).
        if (model_type := raw.get("model_type", "bert")) != "bert":
            raise ValueError(f"{path}: only BERT encoders are supported, got {model_type!r}")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only hidden_act=gelu is supported, got {raw['hidden_act']}")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__})


class _SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        head_dim = width // self.num_heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, length, self.num_heads, head_dim).transpose(1, 2)

        context = F.scaled_dot_product_attention(
            heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden)), attend
        )
        return context.transpose(1, 2).reshape(batch, length, width)


class _DenseNorm(nn.Module):
    """Hugging Face's `BertSelfOutput` / `BertOutput`: dense, residual, LayerNorm."""

    def __init__(self, in_features: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class _Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _DenseNorm(config.hidden_size, config)


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        attended = self.attention.output(self.attention.self(hidden, attend), hidden)
        inner = F.gelu(self.intermediate.dense(attended))
        return self.output(inner, attended)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment inputs: token type 0 everywhere.
        summed = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(summed)


class BertEncoder(nn.Module):
    """Token ids and attention mask in, last hidden states out."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [B, T]; attention_mask: bool [B, T], True on real tokens."""
        hidden = self.embeddings(input_ids)
        attend = attention_mask[:, None, None, :]
        for layer in self.encoder.layer:
            hidden = layer(hidden, attend)
        return hidden

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> BertEncoder:
        config = BertConfig.from_json(model_dir / "config.json")
        model = cls(config)
        state = load_file(str(model_dir / "model.safetensors"))
        # The checkpoint may carry the pooler head and a buffer of position ids; neither is used
        # by sentence embeddings.
        state = {
            name.removeprefix("bert."): tensor
            for name, tensor in state.items()
            if not name.startswith(("pooler.", "bert.pooler."))
            and not name.endswith("position_ids")
        }
        model.load_state_dict(state, strict=True)
        return model.eval()


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens (sentence-transformers' Pooling)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return summed / counts


def normalize_rows(pooled: torch.Tensor, which: Sequence[bool]) -> torch.Tensor:
    """`pooled` with the rows `which` marks L2-normalized (sentence-transformers' Normalize),
    the others as they are."""
    if all(which):
        return F.normalize(pooled, p=2, dim=1)
    if not any(which):
        return pooled
    marked = torch.tensor(which, device=pooled.device).unsqueeze(1)
    return torch.where(marked, F.normalize(pooled, p=2, dim=1), pooled)
