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


def llama(seed: int = 0, layers: int = 2, kv_heads: int = 2, attention: str = "sdpa") -> torch.nn.Module:
    """Hugging Face Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention (`attention="eager"`:
    written out as matmul, softmax, matmul)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attention)
    return LlamaForCausalLM(cfg)


def bert(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face BERT for masked LM."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                     vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForMaskedLM(cfg)


def albert(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face ALBERT for masked LM: one layer's weights shared by every layer (each linear used `layers`
    times), an embedding narrower than the hidden size (16 -> 32)."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(seed)
    cfg = AlbertConfig(num_hidden_layers=layers, embedding_size=16, hidden_size=32, num_attention_heads=4,
                       intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, pad_token_id=0)
    return AlbertForMaskedLM(cfg)


def _deltanet_sizes(layers: int) -> dict:
    """The zoo's sizes of a gated-DeltaNet model (Qwen3-Next, Qwen3.5): 2 key heads and 4 value heads of 8 in the
    linear-attention layers, 4 query heads over 2 kv heads in the full-attention ones, alternating."""
    return dict(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                use_cache=False,
                layer_types=["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2))


def qwen3_next(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Qwen3-Next: a gated DeltaNet layer (fused in_proj_qkvz and in_proj_ba, a depthwise conv1d, the
    chunked delta rule written with tril masks and a loop writing each chunk into a preallocated output, a gated
    RMSNorm per head) then a full-attention layer, each followed by 4 routed experts and a gated shared expert."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**_deltanet_sizes(layers), num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=32))


def qwen3_5(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Qwen3.5 (text): Qwen3-Next's gated DeltaNet with q|k|v in one in_proj_qkv cut only after its
    depthwise conv1d (z, b and a separate), then full attention; a dense SwiGLU MLP."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_deltanet_sizes(layers)))


def falcon_h1(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Falcon-H1: a Mamba-2 mixer beside attention in every layer, its in_proj output scaled per channel
    (muP multipliers: one per part, z | x|B|C | dt) before it is split, x|B|C through a depthwise conv1d."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    cfg = FalconH1Config(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, intermediate_size=64, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                         mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, use_cache=False, ssm_multipliers=[1.0, 0.5, 2.0, 0.25, 1.5])
    return FalconH1ForCausalLM(cfg)


def lfm3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face LFM3: a gated short-convolution layer (in_proj's output transposed, then chunk(3) into B, C and x
    along the channels; B * x through a depthwise conv1d, times C, out_proj) before an attention layer."""
    from transformers import Lfm3Config, Lfm3ForCausalLM

    torch.manual_seed(seed)
    cfg = Lfm3Config(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                     pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                     layer_types=["conv", "full_attention"] * (layers // 2) + ["conv"] * (layers % 2))
    return Lfm3ForCausalLM(cfg)


def builtin_gpt(seed: int = 0, layers: int = 2, seq: int = SEQ) -> torch.nn.Module:
    """meshc's built-in GPT (meshc/models.py) at the zoo's vocabulary and length: tied head, LayerNorm, GELU."""
    from meshc import models

    torch.manual_seed(seed)
    return models.build("gpt-tiny", vocab_size=VOCAB, seq_len=seq, layers=layers, dim=32)


def gpt_vocab(seed: int = 0, layers: int = 1) -> torch.nn.Module:
    """meshc's built-in GPT with a vocabulary of 4096 over a width of 64 (tied head): where the head's compute
    outweighs the collectives that sharding the vocabulary adds, even on the CPU profile (compiler/cost/vocab.py)."""
    from meshc import models

    torch.manual_seed(seed)
    return models.build("gpt-tiny", vocab_size=4096, seq_len=SEQ, layers=layers, dim=64)


MODELS = {"gpt": builtin_gpt, "reference": reference_transformer, "gpt2": gpt2, "llama": llama, "bert": bert,
          "albert": albert, "qwen3_next": qwen3_next, "qwen3_5": qwen3_5,
          "falcon_h1": falcon_h1, "lfm3": lfm3,
          "gpt_vocab": gpt_vocab}


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


def mixtral(seed: int = 0, layers: int = 2, aux_loss: float = 0.0, experts: str | None = None) -> torch.nn.Module:
    """Hugging Face Mixtral: Llama-style attention with a top-2 mixture of 4 experts per block; with `aux_loss`,
    its outputs carry the router's load-balancing loss (output_router_logits) of that coefficient; `experts`
    picks transformers' experts implementation ("batched_mm": each row's expert weights gathered by id)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, num_local_experts=4,
                        num_experts_per_tok=2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        router_aux_loss_coef=aux_loss, output_router_logits=aux_loss > 0)
    if experts is not None:
        cfg._experts_implementation = experts
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
MODELS["llama4"] = lambda seed=0: llama(seed, layers=4)


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


class Seq2SeqLM(torch.nn.Module):
    """An encoder-decoder model fed like the decoder-only ones: forward(tokens) runs the encoder on `tokens` and
    the decoder on `tokens` as well (decoder_input_ids = tokens: causal self-attention, cross-attention to the
    encoder), and returns the decoder's logits, so zoo.lm_loss's next-token loss applies unchanged. The
    decoder can see the next token through cross-attention; that makes the task easy, not the test weaker:
    parity compares the same arithmetic on both sides."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, decoder_input_ids=tokens).logits


def t5(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face T5 (encoder-decoder): one embedding shared by encoder, decoder and the tied LM head,
    cross-attention, relative position bias (bucketed, learned in each stack's first layer), RMS norm. The
    config's default use_cache=True is kept on purpose: the decoder's DynamicCache concatenates its first
    keys onto an empty 1-D tensor (torch.cat skips it), which once crashed tensor parallelism."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=SEQ,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return Seq2SeqLM(T5ForConditionalGeneration(cfg))


def bloom(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face BLOOM: ALiBi attention biases (no position embeddings), fused query_key_value, embedding
    LayerNorm, tied LM head, and an MLP GeLU through a custom autograd.Function (its own backward)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=layers, n_head=4, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return BloomForCausalLM(cfg)


def _falcon(seed: int, layers: int, **layout) -> torch.nn.Module:
    """Hugging Face Falcon at the zoo's sizes (4 query heads, rotary, no dropout) in the given layout."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                       alibi=False, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=SEQ,
                       use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, **layout)
    return FalconForCausalLM(cfg)


def falcon(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Falcon (the 7B architecture): bias-free fused QKV projection with multi-query attention,
    attention and MLP in parallel from one LayerNorm, rotary embeddings."""
    return _falcon(seed, layers, new_decoder_architecture=False, parallel_attn=True, multi_query=True, bias=False)


def falcon_new(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Falcon, the 40B layout (new_decoder_architecture): two LayerNorms, the fused QKV grouped by
    kv head (each group: its query heads, one key, one value; `x @ weight.T` linears), 2 kv heads for 4 query
    heads."""
    return _falcon(seed, layers, num_kv_heads=2, new_decoder_architecture=True, bias=False)


def falcon_groups(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """The 40B layout with as many kv groups as a tp=4 mesh has ranks: 8 query heads in 4 groups of 2 (Falcon-40B:
    128 heads in 8 groups); fewer groups than tp ranks stay replicated (Megatron refuses them)."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=8,
                       num_kv_heads=4, new_decoder_architecture=True, bias=False, alibi=False, hidden_dropout=0.0,
                       attention_dropout=0.0, max_position_embeddings=SEQ, use_cache=False, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)
    return FalconForCausalLM(cfg)


def gpt_bigcode(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face GPT-BigCode (StarCoder) with multi-query attention: one fused c_attn whose output, unsqueezed,
    is split into q (all heads), k and v (one head each); learned positions, a tied head."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(seed)
    cfg = GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=layers, n_positions=SEQ, multi_query=True,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                           eos_token_id=0)
    return GPTBigCodeForCausalLM(cfg)


def stablelm(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face StableLM with qk_layernorm: q and k split into one piece per head, each through its own
    LayerNorm, concatenated back (a norm per head); partial rotary, SwiGLU."""
    from transformers import StableLmConfig, StableLmForCausalLM

    torch.manual_seed(seed)
    cfg = StableLmConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True, max_position_embeddings=SEQ,
                         use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return StableLmForCausalLM(cfg)


def falcon_mha(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Falcon, the old layout without multi-query: the fused QKV interleaved per head (q, k, v of
    head 0, then of head 1...), attention and MLP in parallel from one LayerNorm, biases on the linears."""
    return _falcon(seed, layers, new_decoder_architecture=False, parallel_attn=True, multi_query=False, bias=True)


def phi3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Phi-3: one fused qkv_proj whose q, k and v blocks differ in size (4 query heads, 2 kv heads:
    32 + 16 + 16 rows), cut by slices; one fused gate_up_proj cut by chunk; RMSNorm, rotary embeddings."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                     original_max_position_embeddings=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                     use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Phi3ForCausalLM(cfg)


def gpt_neox(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face GPT-NeoX: the fused query_key_value interleaved per head (q, k, v of head 0, then head 1...),
    viewed as heads and chunked into q, k, v; partial rotary; attention and MLP in parallel."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPTNeoXForCausalLM(cfg)


def gptj(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face GPT-J: interleaved partial rotary (pairs of channels rotated, put back with torch.stack and
    flatten) on 4 of each head's 8 channels, attention and MLP in parallel from one LayerNorm."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(seed)
    cfg = GPTJConfig(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=layers, n_positions=SEQ, rotary_dim=4,
                     n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                     eos_token_id=0, pad_token_id=0)
    return GPTJForCausalLM(cfg)


MODELS.update(t5=t5, bloom=bloom, falcon=falcon, falcon_new=falcon_new, falcon_groups=falcon_groups, falcon_mha=falcon_mha, gpt_bigcode=gpt_bigcode, stablelm=stablelm, phi3=phi3,
              gpt_neox=gpt_neox, gptj=gptj)


def deepseek_v3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face DeepSeek-V3: multi-head latent attention, a dense first layer, then routed experts (sigmoid
    router with grouped top-k and a score-correction bias) beside a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=VOCAB,
                           max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    return DeepseekV3ForCausalLM(cfg)


def olmoe(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face OLMoE: q/k norms over the whole projection, softmax top-2 of 8 experts, no shared expert."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    cfg = OlmoeConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=VOCAB,
                      max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      router_aux_loss_coef=0.0)
    return OlmoeForCausalLM(cfg)


def gpt_oss(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face GPT-OSS: experts stored (E, in, out) and read as they are by a grouped matmul, per-expert biases
    gathered by the rows' expert ids, gate and up interleaved in one projection (`[..., ::2]`, `[..., 1::2]`), a
    router with a bias; attention with learned sinks (eager attention), 2 kv heads."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=VOCAB, max_position_embeddings=SEQ, layer_types=["full_attention"] * layers,
                       use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, router_aux_loss_coef=0.0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # the config's init leaves the biases and sinks at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.02)
    return model


def llama4_moe(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Llama 4 (text): every token through every expert by bmm over (E, in, out) weights, scaled by the
    router's sigmoid scores (zero off its top-k), gate|up fused and chunked; a shared expert beside them."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    cfg = Llama4TextConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=VOCAB,
                           max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, router_aux_loss_coef=0.0)
    model = Llama4ForCausalLM(cfg)
    with torch.no_grad():  # transformers leaves the experts' gate_up at zero (loaded from a checkpoint in practice)
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0.0, 0.05)
    return model


def jetmoe(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face JetMoE: experts as a loop, one `F.linear(rows, weight[i])` per expert over a stack (E, out, in)
    with rows split by counts read at run time (`.tolist()`), summed back by index_add; its attention's queries and
    outputs are such experts too (a mixture of attention heads), k and v one projection repeated per routed head."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(seed)
    cfg = JetMoeConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                       vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False, output_router_logits=False,
                       bos_token_id=0, eos_token_id=0)
    model = JetMoeForCausalLM(cfg)
    with torch.no_grad():  # the layers' output biases start at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def zamba(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Zamba's Mamba layers: in_proj's output cut into heads, then a loop over the heads, each scanned on
    its own (`x[h]`, `A[h]`, `D[h]`, ... of per-head stacks), the scans joined by a cat before out_proj."""
    from transformers import ZambaConfig, ZambaForCausalLM

    torch.manual_seed(seed)
    cfg = ZambaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, attention_head_dim=16, n_mamba_heads=4, mamba_d_state=8, mamba_dt_rank=4,
                      layer_types=["mamba"] * layers, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return ZambaForCausalLM(cfg)


def rwkv(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face RWKV (v4): time mixing as a loop over time steps that writes each step's output into a buffer made
    like the key projection's output (`out = zeros_like(k); out[:, t] = ...`), reading the value projection's; channel
    mixing gates the value layer's output by a sigmoid of a third projection (receptance). Its FFN 4x its width, as in
    RWKV's own configs (the share of its blocks' bytes sharded depends on it)."""
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(seed)
    cfg = RwkvConfig(num_hidden_layers=layers, hidden_size=32, attention_hidden_size=32, intermediate_size=128,
                     vocab_size=VOCAB, context_length=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0)
    return RwkvForCausalLM(cfg)


def xlstm(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face xLSTM (mLSTM blocks, trained chunkwise): q, k, v and gate projections per head, the chunked
    recurrence, a norm per head (var over the head dim), gates through log_sigmoid, cat written torch.concatenate."""
    from transformers import xLSTMConfig, xLSTMForCausalLM

    torch.manual_seed(seed)
    cfg = xLSTMConfig(vocab_size=VOCAB, hidden_size=32, embedding_dim=32, num_hidden_layers=layers,
                      num_blocks=layers, num_heads=4, mode="train", chunk_size=8,
                      autocast_kernel_dtype="float32", ffn_round_up_to_multiple_of=16, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return xLSTMForCausalLM(cfg)


MODELS["deepseek_v3"] = deepseek_v3
MODELS["xlstm"] = xlstm
MODELS["rwkv"] = rwkv
MODELS["zamba"] = zamba
MODELS["jetmoe"] = jetmoe
MODELS["gpt_oss"] = gpt_oss
MODELS["llama4_moe"] = llama4_moe
MODELS["olmoe"] = olmoe
MODELS["mixtral4"] = lambda seed=0: mixtral(seed, layers=4)
MODELS["mixtral_gathered"] = lambda seed=0, layers=2: mixtral(seed, layers=layers, experts="batched_mm")


def qwen2(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Qwen2: Llama-style with biases on q, k and v, rotary, grouped-query attention (4 heads, 2 kv)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=LONG, use_cache=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(cfg)


LONG = 256  # the longest sequence the context-parallel tests train on
MODELS["qwen2"] = qwen2
MODELS["gpt_long"] = lambda seed=0: builtin_gpt(seed, seq=LONG)
MODELS["llama_eager"] = lambda seed=0: llama(seed, attention="eager")


def mistral(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Mistral with a sliding window of 8 tokens: a mask that is neither causal nor nothing."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=LONG, sliding_window=8,
                        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return MistralForCausalLM(cfg)


MODELS["mistral"] = mistral


def _plain_llama3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    from tests.plain_models import llama3

    return llama3(seed, layers)


def _encoder_lm(seed: int = 0, layers: int = 2, batch_first: bool = True) -> torch.nn.Module:
    from tests.plain_models import encoder_lm

    return encoder_lm(seed, layers, batch_first)


def _plain(name: str):
    def build(seed: int = 0, layers: int = 2) -> torch.nn.Module:
        from tests import plain_models

        return getattr(plain_models, name)(seed, layers)
    return build


MODELS["seq2seq_plain"] = _plain("seq2seq")
MODELS["vit_plain"] = _plain("vit")
MODELS["mha_plain"] = _plain("mha_variants")
MODELS["nanogpt_plain"] = _plain("nanogpt")
MODELS["scan_plain"] = _plain("scan_lm")
MODELS["widening_plain"] = _plain("widening")
MODELS["loop_moe_plain"] = _plain("loop_moe")
MODELS["head_loop_plain"] = _plain("head_loop")
MODELS["head_list_plain"] = _plain("head_list")
LOSS_INSIDE = {"nanogpt_plain"}  # forward(tokens, targets) -> (logits, loss): trained on that loss (model_loss)


def model_loss(name: str, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A training step's loss for zoo model `name` called as a user calls it: its own loss where forward computes
    one (LOSS_INSIDE), else lm_loss of its outputs."""
    if name in LOSS_INSIDE:
        return model(x, y)[1]
    return lm_loss(model(x), y)
IMAGE_MODELS = {"vit_plain"}  # trained on (images, class labels): batches_for


def batches_for(name: str, steps: int, batch: int, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches model `name` trains on: (tokens, next tokens), or (images, labels) for an image model
    (lm_loss is their cross-entropy either way)."""
    if name in IMAGE_MODELS:
        from tests.plain_models import image_batches

        return image_batches(steps, batch)
    return batches(steps, batch, seq=seq)


MODELS["llama3_plain"] = _plain_llama3
MODELS["encoder_lm"] = _encoder_lm
MODELS["encoder_lm_seq_first"] = lambda seed=0: _encoder_lm(seed, batch_first=False)


def mamba2(seed: int = 0, layers: int = 2, groups: int = 1) -> torch.nn.Module:
    """Hugging Face Mamba-2 (torch path, no attention): in_proj's output cut into z | x|B|C | dt, x|B|C through a
    depthwise causal conv1d then cut into x, B, C (B and C per group: `groups` of them), the chunked SSD scan per head
    (8 heads of 8, 2 chunks of 8 tokens), a gated RMSNorm over all heads, out_proj."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_heads=8, head_dim=8,
                       state_size=8, n_groups=groups, expand=2, chunk_size=8, conv_kernel=4, use_cache=False,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Mamba2ForCausalLM(cfg)


MODELS["mamba2"] = mamba2


def mamba(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """Hugging Face Mamba (the first, torch path): in_proj's output cut into x | z, x through a depthwise causal conv1d,
    x_proj to the time step (rank 2), B and C, the time step widened per channel by `dt_proj.weight @ dt` (a weight
    read by a matmul, not a linear) plus its bias, the selective scan per channel with A = -exp(A_log), out_proj."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, state_size=8, expand=2,
                      conv_kernel=4, time_step_rank=2, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return MambaForCausalLM(cfg)


MODELS["mamba"] = mamba
MODELS["mamba2_groups"] = lambda seed=0: mamba2(seed, groups=4)  # B and C of 4 groups: sharded with their heads


def dory(seed: int = 0) -> torch.nn.Module:
    """Hugging Face Dory (nGPT on the unit sphere): every norm an L2 norm (`x * rsqrt(sum(x²))`, a sum, not a mean),
    two of them between a column- and a row-parallel layer (over the attention's gated heads and over the MLP's
    features), per-channel scales read beside the projections, a middle layer looped twice with its weights shared."""
    from transformers import DoryConfig, DoryForCausalLM

    torch.manual_seed(seed)
    cfg = DoryConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, n_input_layers=1,
                     n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2, sliding_window=SEQ, use_cache=False,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return DoryForCausalLM(cfg)


MODELS["dory"] = dory


def hy_v4(seed: int = 0) -> torch.nn.Module:
    """Hugging Face HY-V4: multi-head latent attention whose key heads are built in a buffer made like the expanded
    latent (`kv.new_empty(*kv.shape[:-1], d)`, the no-rope and rope parts copied into its two slices), a sparse-attention
    indexer run under no_grad, hyper-connections, a dense first layer and routed experts beside a shared one."""
    from transformers import HYV4Config, HYV4ForCausalLM

    torch.manual_seed(seed)
    cfg = HYV4Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=8,
                     index_topk=8, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
                     layer_types=["indexed_attention"] * 2, indexer_types=["full", "shared"], use_cache=False,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = HYV4ForCausalLM(cfg)
    for name, p in model.named_parameters():  # the indexer runs under no_grad: the LM loss gives it no gradient
        if ".indexer." in name:
            p.requires_grad_(False)
    return model


MODELS["hy_v4"] = hy_v4


def hrm_text(seed: int = 0) -> torch.nn.Module:
    """Hugging Face HRM-Text: a low-level and a high-level stack of layers, each applied in cycles with its weights
    shared; the low-level stack's early cycles run under `torch.no_grad()` (only its trailing cycle trains)."""
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(seed)
    cfg = HrmTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, head_dim=8, H_cycles=2, L_cycles=2, L_bp_cycles=[1],
                        max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HrmTextForCausalLM(cfg)


MODELS["hrm_text"] = hrm_text


def diffllama(seed: int = 0, kv_heads: int = 4) -> torch.nn.Module:
    """Hugging Face DiffLlama: differential attention pairs head h with head h + H/2 (the attention's output cut in two
    by `chunk(2)` over the heads, v's kv heads likewise, each half repeated to every kv head)."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(seed)
    cfg = DiffLlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                          use_cache=False,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return DiffLlamaForCausalLM(cfg)


MODELS["diffllama"] = diffllama
MODELS["diffllama_kv2"] = lambda seed=0: diffllama(seed, kv_heads=2)  # each half of v one kv head: fewer than tp=2


class PromptLM(torch.nn.Module):
    """Each token position attending over its own two streams first (the embedding and a layer's output, a learned
    query: Inkling2's attention residuals, the sequence in SDPA's heads dim); then learned prompt vectors put before the
    tokens (a `cat` on the sequence, as CPM-Ant does), a causal self-attention block over both, and the prompt cut off
    again before the head."""

    def __init__(self, dim: int = 32, prompt: int = 4, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.pre = torch.nn.Linear(dim, dim)
        self.mix = torch.nn.Parameter(torch.randn(dim) * 0.5)
        self.prompt = torch.nn.Parameter(torch.randn(prompt, dim) * 0.02)
        # no bias on qkv: k's would have a gradient of zero but for rounding (softmax ignores a constant per query),
        # which AdamW turns into steps of lr either way, a parameter that no comparison can hold to a tolerance
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        b, t = tokens.shape
        e = self.embed(tokens)
        streams = torch.stack([e, e + torch.tanh(self.pre(e))], dim=2)  # (B, T, 2, dim): each position's two streams
        e = torch.nn.functional.scaled_dot_product_attention(self.mix.expand(b, t, 1, -1), streams, streams).squeeze(2)
        x = torch.cat([self.prompt.expand(b, -1, -1), e], dim=1)
        q, k, v = (z.unflatten(-1, (self.heads, -1)).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.proj(a.transpose(1, 2).flatten(2))
        return self.head(self.norm(h[:, self.prompt.shape[0]:]))


def prompt_lm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return PromptLM()


MODELS["prompt_lm"] = prompt_lm
