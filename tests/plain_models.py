"""Language models written in plain PyTorch the way people write them (no transformers), for tests.

`llama3`: a Llama 3 in a reference trainer's style: complex rotary embeddings (torch.polar, view_as_complex,
view_as_real), grouped-query attention with kv heads repeated by expand + reshape, the attention output written
`transpose(1, 2).contiguous().view(bs, seqlen, -1)` (a view that is valid at trace time only because the transposed
tensor happens to be contiguous there), RMSNorm, SwiGLU, an untied head and its own `init_weights`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


def precompute_freqs_cis(dim: int, end: int, theta: float = 500000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64, (end, dim / 2)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                     head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.scale_in_place: float | None = None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys = repeat_kv(xk, self.n_heads // self.n_kv_heads)
        values = repeat_kv(xv, self.n_heads // self.n_kv_heads)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        if self.scale_in_place is not None:  # a write through that view (tests/passes/test_layout.py)
            output.mul_(self.scale_in_place)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 hidden: int = 64, max_seq: int = SEQ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden) for i in range(layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq * 2), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        std = 0.02 / math.sqrt(2 * len(self.layers))
        for block in self.layers.values():
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(linear.weight, std=0.02)
            for linear in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(linear.weight, std=std)
        nn.init.trunc_normal_(self.output.weight, std=self.tok_embeddings.weight.shape[1] ** -0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def llama3(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return Llama3(layers=layers)


class EncoderLM(nn.Module):
    """A language model on torch's own nn.TransformerEncoder (nn.MultiheadAttention with its packed in_proj_weight,
    pre-norm), causal; `batch_first` either way."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=batch_first, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h if self.batch_first else h.transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.encoder(h, mask=mask, is_causal=True)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h)


def encoder_lm(seed: int = 0, layers: int = 2, batch_first: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return EncoderLM(layers=layers, batch_first=batch_first)


def encoder_lm_with_batch(layers: int = 2) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A factory as `meshc explain --model tests.plain_models:encoder_lm_with_batch` takes it: the model and one
    global batch of 8 sequences of SEQ tokens."""
    return encoder_lm(layers=layers), (torch.randint(0, VOCAB, (8, SEQ)),)



class Seq2Seq(nn.Module):
    """An encoder-decoder on torch's own nn.Transformer (pre-norm): the encoder reads the tokens, the decoder reads
    them again under a causal mask and attends to the encoder's output (cross-attention: nn.MultiheadAttention with
    query and key apart, its in_proj_weight split into q and k|v before two linears)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.src_embed, self.tgt_embed = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, heads, layers, layers, 2 * dim, dropout=0.0, batch_first=True,
                                          norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.transformer(self.src_embed(tokens), self.tgt_embed(tokens), tgt_mask=mask, tgt_is_causal=True)
        return self.head(h)


def seq2seq(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return Seq2Seq(layers=layers)


IMAGE, PATCH, CLASSES = 16, 4, 10  # 16x16 RGB images in 4x4 patches: 16 patches, 10 classes


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """A vision transformer in the style of the common reference implementations: a Conv2d patch embedding, a class
    token and learned positions, pre-norm blocks with a fused qkv projection (reshape, permute, unbind), SDPA, and a
    linear classifier on the class token."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def vit(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return ViT(layers=layers)


def image_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (images, class labels) for ViT."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(steps)]


def seq2seq_with_batch(layers: int = 2) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A factory for `meshc explain --model tests.plain_models:seq2seq_with_batch`: the model and a global batch."""
    return seq2seq(layers=layers), (torch.randint(0, VOCAB, (8, SEQ)),)


def vit_with_batch(layers: int = 2) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A factory for `meshc explain --model tests.plain_models:vit_with_batch`: the model and a global batch."""
    return vit(layers=layers), (torch.randn(8, 3, IMAGE, IMAGE),)


class MHAVariants(nn.Module):
    """nn.MultiheadAttention in its other forms: self-attention with a boolean causal attn_mask, a key_padding_mask
    (token 0 is padding) and need_weights=True (the head-averaged weights computed, as the module's default, and
    added to the output so that they are used); and attention over a narrower side input with separate q/k/v weights
    (kdim = vdim != embed_dim: q_proj_weight, k_proj_weight, v_proj_weight), batch first."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, side: int = 16, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed, self.side = nn.Embedding(vocab, dim), nn.Embedding(vocab, side)
        self.self_attn = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.cross = nn.ModuleList(nn.MultiheadAttention(dim, heads, kdim=side, vdim=side, batch_first=True)
                                   for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, side = self.embed(tokens), self.side(tokens)
        s = tokens.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).triu(1)
        padding = tokens == 0
        padding = padding & ~padding[:, :1]  # the first key stays visible: no row is all padding
        for i, (attn, cross) in enumerate(zip(self.self_attn, self.cross)):
            x = self.norms[2 * i](h)
            out, weights = attn(x, x, x, attn_mask=causal, key_padding_mask=padding)
            h = h + out + weights.mean(-1, keepdim=True)
            x = self.norms[2 * i + 1](h)
            out, _ = cross(x, side, side, need_weights=False)
            h = h + out
        return self.head(h)


def mha_variants(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return MHAVariants(layers=layers)


class NanoGPT(nn.Module):
    """A GPT in nanoGPT's style: one fused c_attn split into q, k, v, views to heads, causal SDPA, a GELU MLP,
    learned positions, the LM head tied to the token embedding, and the loss computed inside forward:
    `logits, loss = model(idx, targets)` (loss None without targets)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, layers: int = 2, block: int = SEQ):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList(nn.ModuleDict(dict(ln_1=nn.LayerNorm(dim), c_attn=nn.Linear(dim, 3 * dim),
                                                  c_proj=nn.Linear(dim, dim), ln_2=nn.LayerNorm(dim),
                                                  c_fc=nn.Linear(dim, 4 * dim), mlp_proj=nn.Linear(4 * dim, dim)))
                               for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def _attn(self, block: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = block["c_attn"](x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return block["c_proj"](y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = x + self._attn(block, block["ln_1"](x))
            x = x + block["mlp_proj"](F.gelu(block["c_fc"](block["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return NanoGPT(layers=layers)


class _ScanBlock(nn.Module):
    """A gated scan over the sequence (a linear-recurrence mixer written with torch's scan ops): a running
    log-sum-exp of one projection, decayed by the running product of a sigmoid gate of another."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.gate = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):  # (B, T, W)
        h = self.norm(x)
        mixed = torch.logcumsumexp(self.up(h), dim=1) * torch.cumprod(torch.sigmoid(self.gate(h)), dim=1)
        return x + self.down(mixed)


class _BlocksLM(nn.Module):
    """`layers` blocks made by `block()` between a token embedding and a head (built in that order)."""

    def __init__(self, width: int, layers: int, block):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ScanLM(_BlocksLM):
    """Blocks of _ScanBlock between a token embedding and a head: ops meshc has no rule of its own for
    (logcumsumexp, cumprod), placed by DTensor's strategies."""

    def __init__(self, width: int = 32, layers: int = 2):
        super().__init__(width, layers, lambda: _ScanBlock(width))


def scan_lm(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return ScanLM(layers=layers)


class _WideningBlock(nn.Module):
    """A pre-norm residual block of three linear layers widening h -> 4h -> 16h and back to h (a bottleneck turned
    inside out): Megatron's rule taken in graph order pairs the first two and all-reduces the 16h-wide middle; pairing
    the last two shards more bytes and all-reduces an h-wide output."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.a, self.b, self.c = nn.Linear(width, 4 * width), nn.Linear(4 * width, 16 * width), nn.Linear(16 * width, width)

    def forward(self, x):
        return x + self.c(F.gelu(self.b(F.gelu(self.a(self.norm(x))))))


class WideningLM(nn.Module):
    def __init__(self, width: int = 16, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(_WideningBlock(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def widening(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return WideningLM(layers=layers)


class _Head(nn.Module):
    """One attention head as a module of its own (the style of the best-known from-scratch GPT tutorials)."""

    def __init__(self, width: int, size: int):
        super().__init__()
        self.key, self.query = nn.Linear(width, size, bias=False), nn.Linear(width, size, bias=False)
        self.value = nn.Linear(width, size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(SEQ, SEQ)))

    def forward(self, x):
        t = x.shape[1]
        k, q = self.key(x), self.query(x)
        wei = (q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5).masked_fill(self.tril[:t, :t] == 0, float("-inf"))
        return F.softmax(wei, dim=-1) @ self.value(x)


class _HeadListBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = nn.ModuleList(_Head(width, width // heads) for _ in range(heads))
        self.proj = nn.Linear(width, width)
        self.ffwd = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.proj(torch.cat([head(h) for head in self.heads], dim=-1))
        return x + self.ffwd(self.ln2(x))


class HeadListGPT(nn.Module):
    """A GPT whose attention is a ModuleList of per-head modules concatenated: each head's q, k, v are separate
    (width, width / heads) linear layers."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.blocks = nn.Sequential(*(_HeadListBlock(width, heads) for _ in range(layers)))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln_f(self.blocks(x)))


def head_list(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return HeadListGPT(layers=layers)


class _Expert(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, hidden, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))


class _LoopMoE(nn.Module):
    """A top-2 mixture of experts as reference implementations write it: a ModuleList of experts, a Python loop over
    them, the rows of each picked by torch.where (their count known only at run time) and added back in place
    (`results[b, t] += w * expert(x[b, t])`)."""

    def __init__(self, width: int, hidden: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(width, hidden) for _ in range(experts))

    def forward(self, x):
        h = self.norm(x)
        weights, chosen = torch.topk(self.gate(h), 2)
        weights = F.softmax(weights, dim=-1, dtype=torch.float).to(h.dtype)
        results = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            b, t, nth = torch.where(chosen == i)
            results[b, t] += weights[b, t, nth, None] * expert(h[b, t])
        return x + results


class LoopMoELM(_BlocksLM):
    def __init__(self, width: int = 32, hidden: int = 64, experts: int = 4, layers: int = 2):
        super().__init__(width, layers, lambda: _LoopMoE(width, hidden, experts))


def loop_moe(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return LoopMoELM(layers=layers)


class _HeadLoop(nn.Module):
    """A mixer that runs each head on its own, as Zamba's Mamba layers do: the input projected and cut into heads, a
    loop over the heads reading each one's slice and its own parameters (`scale[h]`) beside a matrix every head
    shares (`mix`), a running sum over time in each, the heads' results joined by a cat before the output projection."""

    def __init__(self, width: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.LayerNorm(width)
        self.inp = nn.Linear(width, heads * head_dim)
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(heads, head_dim))
        self.mix = nn.Parameter(torch.randn(head_dim, head_dim) / head_dim ** 0.5)
        self.out = nn.Linear(heads * head_dim, width)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.inp(self.norm(x)).view(b, t, self.heads, self.head_dim).permute(2, 0, 1, 3)  # (heads, b, t, d)
        outs = []
        for i in range(self.heads):
            y = torch.tanh(h[i] * self.scale[i]) @ self.mix
            outs.append(y.cumsum(1) / t)
        return x + self.out(torch.cat(outs, dim=-1))


class HeadLoopLM(_BlocksLM):
    def __init__(self, width: int = 32, heads: int = 4, head_dim: int = 8, layers: int = 2):
        super().__init__(width, layers, lambda: _HeadLoop(width, heads, head_dim))


def head_loop(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return HeadLoopLM(layers=layers)
