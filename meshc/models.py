"""Built-in models for the demo, `meshc explain` and `meshc plan`: a compact GPT in plain torch.nn, and
Hugging Face transformers models (Llama-3 8B/70B/405B, Mixtral 8x7B, or any config file) built from
their configs with random weights; under fake tensors (`meshc explain`) they cost no memory.

GPT here is GPT-2's architecture (learned positions, pre-LayerNorm blocks, fused qkv projection, GELU
MLP, LM head tied to the token embedding) written with nn.Linear, so that tracing sees aten.linear.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshc.compiler.ir.errors import MeshcValueError


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 50304
    seq_len: int = 1024
    layers: int = 12
    heads: int = 12
    dim: int = 768
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise MeshcValueError(f"GPTConfig: expected dim divisible by heads, got dim={self.dim}, heads={self.heads}")


CONFIGS = {
    "gpt-tiny": GPTConfig(vocab_size=128, seq_len=64, layers=2, heads=4, dim=128),
    "gpt2-small": GPTConfig(layers=12, heads=12, dim=768),
    "gpt2-medium": GPTConfig(layers=24, heads=16, dim=1024),
    "gpt2-large": GPTConfig(layers=36, heads=20, dim=1280),
    "gpt2-xl": GPTConfig(layers=48, heads=25, dim=1600),
}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 × (B, T, D)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """The init of every module (also what meshc.init_weights applies, one tensor at a time)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


def build(name: str, **overrides) -> nn.Module:
    """A built-in model by name (see NAMES) or a transformers config file (a path ending in .json), with
    config fields overridden by keyword (`layers` and `seq_len` work for every model)."""
    if name in CONFIGS:
        base = CONFIGS[name]
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields.update(overrides)
        return GPT(GPTConfig(**fields))
    return _hf_model(hf_config(name, **overrides))


# Hugging Face configs (config.json fields) of the published models, built with random weights.
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")
HF_CONFIGS = {
    "llama3-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama3-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8},
    "llama3-405b": {**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                    "num_attention_heads": 128, "num_key_value_heads": 8},
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, router_aux_loss_coef=0.0),
}
ALIASES = {"llama-8b": "llama3-8b", "llama-70b": "llama3-70b", "llama-405b": "llama3-405b", "mixtral": "mixtral-8x7b"}
SEQ = {"llama3-8b": 8192, "llama3-70b": 8192, "llama3-405b": 8192, "mixtral-8x7b": 4096}
NAMES = tuple(CONFIGS) + tuple(HF_CONFIGS) + tuple(ALIASES)
_RENAME = {"layers": "num_hidden_layers", "seq_len": "max_position_embeddings"}


def hf_config(name: str, **overrides):
    """The transformers config of a built-in model (or of a config.json file), with overrides applied."""
    from transformers import AutoConfig

    fields = _config_fields(name)
    fields.update({_RENAME.get(k, k): v for k, v in overrides.items()})
    fields.update(use_cache=False)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise MeshcValueError(f"model: expected a 'model_type' field in the config of {name!r}, got none")
    return AutoConfig.for_model(model_type, **fields)


def _config_fields(name: str) -> dict:
    name = ALIASES.get(name, name)
    if name in HF_CONFIGS:
        return dict(HF_CONFIGS[name])
    if name.endswith(".json"):
        import json
        import os

        if not os.path.exists(name):
            raise MeshcValueError(f"model: expected a transformers config file at {name}, got no such file")
        with open(name) as f:
            fields = json.load(f)
        return {k: v for k, v in fields.items() if k not in ("architectures", "transformers_version", "torch_dtype",
                                                              "dtype", "auto_map", "_name_or_path")}
    raise MeshcValueError(f"model: unknown built-in model {name!r}: expected one of {', '.join(NAMES)}, or a "
                          "transformers config file (path ending in .json)")


def _hf_model(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def seq_len(name: str) -> int:
    """The default sequence length of a built-in model (a config file: its max_position_embeddings, capped)."""
    if name in CONFIGS:
        return CONFIGS[name].seq_len
    name = ALIASES.get(name, name)
    if name in SEQ:
        return SEQ[name]
    cfg = _config_fields(name)
    return int(min(cfg.get("max_position_embeddings", cfg.get("n_positions", 2048)), 8192))


def shape(name: str, seq: int | None = None):
    """The ModelShape (sizes the cost model's formulas need) of a built-in model or config file."""
    from meshc.compiler.cost.formulas import ModelShape

    if name in CONFIGS:
        c = CONFIGS[name]
        return ModelShape(name=name, layers=c.layers, hidden=c.dim, heads=c.heads, ffn=4 * c.dim, vocab=c.vocab_size,
                          seq=seq or c.seq_len, tied=True, positions=c.seq_len, bias=True, norm="layer")
    # a built-in config sets every field the shape reads: read them as they are, without importing transformers
    # (seconds); a config file may rely on transformers' defaults for the fields it leaves out
    builtin = ALIASES.get(name, name) in HF_CONFIGS
    cfg = SimpleNamespace(**_config_fields(name)) if builtin else hf_config(name)
    return ModelShape.from_hf_config(cfg, seq=seq or seq_len(name), name=ALIASES.get(name, name))


def vocab_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    return int(getattr(cfg, "vocab_size"))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
