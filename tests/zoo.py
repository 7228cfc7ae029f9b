"""Small real models for tests, built from configs with random weights (nothing is downloaded).

Every builder is deterministic in its seed, so a rank process and the test process build identical
weights. Dropout is off: parity against one process needs the same arithmetic on both sides.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ = 64, 16


def reference_transformer(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """torch's own reference Transformer (tied embedding and output, LayerNorm, GELU MLP)."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelArgs(n_layers=layers, vocab_size=VOCAB, max_seq_len=SEQ, dim=32, n_heads=4,
                                 dropout_p=0.0))


def gpt2(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face GPT-2: fused c_attn Conv1D, tied LM head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def llama(seed: int = 0, layers: int = 2, kv_heads: int = 2) -> torch.nn.Module:
    """Hugging Face Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def bert(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face BERT for masked LM."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg)


MODELS = {"reference": reference_transformer, "gpt2": gpt2, "llama": llama, "bert": bert}


def build(name: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    return MODELS[name](seed, **kwargs)


def batches(steps: int, batch: int, seed: int = 1, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (tokens, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token; takes a logits tensor or a transformers ModelOutput."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mixtral(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Mixtral: Llama-style attention with a top-2 mixture of 4 experts per block."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, num_local_experts=4,
                        num_experts_per_tok=2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        router_aux_loss_coef=0.0)
    return MixtralForCausalLM(cfg)


MODELS["mixtral"] = mixtral


class Uneven(torch.nn.Module):
    """Sizes that divide no rank count: a 7x15 weight, a 15-wide embedding, biases of 7 and 15."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 15)
        self.norm = torch.nn.LayerNorm(15)
        self.down = torch.nn.Linear(15, 7)
        self.up = torch.nn.Linear(7, 15)
        self.head = torch.nn.Linear(15, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)  # (B, T, 15)
        x = x + self.up(torch.tanh(self.down(self.norm(x))))
        return self.head(x)


def uneven(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Uneven()


MODELS["uneven"] = uneven
MODELS["reference4"] = lambda seed=0: reference_transformer(seed, layers=4)
MODELS["gpt2_4"] = lambda seed=0: gpt2(seed, layers=4)


class StraightThrough(torch.autograd.Function):
    """Forward: round to multiples of 1/8; backward: the identity (a straight-through estimator). The ATen
    derivative of round is zero, so a trace that drops this backward trains with no gradient through it."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 8) / 8

    @staticmethod
    def backward(ctx, grad):
        return grad


class GradReverse(torch.autograd.Function):
    """Forward: the identity (a view of its input); backward: -scale times the gradient (gradient reversal)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class _CustomAct(torch.nn.Module):
    def forward(self, x):
        return GradReverse.apply(StraightThrough.apply(F.silu(x)), 0.5)


def custom_fn(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Llama whose MLP activation goes through two custom autograd Functions (their own backward)."""
    model = llama(seed, layers)
    for layer in model.model.layers:
        layer.mlp.act_fn = _CustomAct()
    return model


MODELS["custom_fn"] = custom_fn
