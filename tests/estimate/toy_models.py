"""Small real models for the traced-vs-measured tests and the estimate benchmark."""

from __future__ import annotations

import torch
from torch import nn


def mlp(width: int = 1024) -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, an LM head."""

    def __init__(
        self, vocab: int = 2048, d: int = 128, layers: int = 2, heads: int = 4, ctx: int = 128
    ) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(
            idx.shape[1], device=idx.device, dtype=x.dtype
        )
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class DataDependent(nn.Module):
    """A Python branch on a tensor's value: fake tensors cannot decide it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


class Gram(nn.Module):
    """A batch × batch Gram matrix: memory grows with the square of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h @ h.T


class CacheFromTwo(nn.Module):
    """A buffer kept on the module once a batch has two or more samples: the step from
    one sample to two costs more than any later one (memory grows less than linearly)."""

    def __init__(self, cache_floats: int = 256) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.cache_floats = cache_floats
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:  # a shape, not a value: fake tensors decide it
            self.cache = torch.zeros(self.cache_floats)
        return self.a(x)


class NoBatch(nn.Module):
    """Takes a scalar: nothing in its step grows with a batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.ones(4, 16) * x)


def cases() -> list[tuple[str, nn.Module, list[torch.Tensor]]]:
    """(name, model, two batches of different size) for the accuracy test and bench."""
    torch.manual_seed(0)
    return [
        ("MLP", mlp(), [torch.randn(32, 256), torch.randn(128, 256)]),
        (
            "GPT",
            TinyGPT(),
            [torch.randint(0, 2048, (4, 128)), torch.randint(0, 2048, (16, 128))],
        ),
        ("ConvNet", SmallConvNet(), [torch.randn(8, 3, 32, 32), torch.randn(32, 3, 32, 32)]),
    ]


@torch.library.custom_op("nbgpu_test::opaque_scale", mutates_args=())
def opaque_scale(x: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake (meta) kernel, like an extension's CUDA op."""
    return x * 2


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opaque_scale(self.a(x))


class _Config:
    """The two things nbgpu reads from a transformers config: attributes and to_dict()."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, inter: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = _Attention(d, heads, kv_heads)
        self.gate = nn.Linear(d, inter, bias=False)
        self.up = nn.Linear(d, inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """A Llama-shaped decoder (RMSNorm, GQA with SDPA, SwiGLU) with an HF-style config."""

    def __init__(
        self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 2
    ) -> None:
        super().__init__()
        inter = 688
        self.config = _Config(
            model_type="llama",
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=inter,
            vocab_size=vocab,
            tie_word_embeddings=False,
            hidden_act="silu",
        )
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads, kv_heads, inter) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
