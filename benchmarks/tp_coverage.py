"""Tensor-parallel coverage: the share of the blocks' weight bytes the automatic plan holds sharded at tp=2,
over transformers families built from small configs and models written in plain PyTorch (tests/plain_models.py:
rows "plain: ..."), with the plan's reason for each replicated module.

    python benchmarks/tp_coverage.py [--tp 2] [--only falcon,phi3] [--own-sizes]

Each model is built and compiled for rank 0 on fake tensors with no process group (as `meshc explain` does):
no weights, no processes (a model that reads a tensor's value while tracing, as ViT does, is built with real
weights instead: the configs are tiny). Parity tests show the sharded runs are right; this shows they shard. What counts as
a block weight: compiler/ir/coverage.py. Prints a markdown table.

A share of bytes depends on the model's proportions, which the small configs change (hidden 64 and FFN 128 for every
family: RWKV's own FFN is 4x its width, HY-V4's hyper-connection matrices are a tenth of its block at width 64).
`--own-sizes` builds each transformers family at its config's default sizes instead (the dims below left to the
config; its 2 layers, its vocabulary cut to VOCAB), on fake tensors: the proportions a user's model has.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, SEQ, BATCH = 128, 16, 2
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128)
LM = dict(max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)

# family -> (config class, model class, config kwargs, input: "tokens" | "pixels")
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2}, "tokens"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2}, "tokens"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2}, "tokens"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16}, "tokens"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2}, "tokens"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                  num_hidden_layers=2, ffn_dim=128, word_embed_proj_dim=64,
                                                  dropout=0.0, **LM), "tokens"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=SEQ,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
             "tokens"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**SMALL, **LM}, "tokens"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2, n_positions=SEQ,
                                                     rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                     use_cache=False), "tokens"),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                         num_hidden_layers=2, new_decoder_architecture=False,
                                                         multi_query=True, parallel_attn=True, bias=False, **LM),
               "tokens"),
    "falcon-mha": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                             num_hidden_layers=2, new_decoder_architecture=False,
                                                             multi_query=False, parallel_attn=True, bias=True, **LM),
                   "tokens"),
    "falcon-new": ("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                                                             num_kv_heads=2, num_hidden_layers=2,
                                                             new_decoder_architecture=True, bias=False, **LM),
                   "tokens"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=2,
                                                                      n_positions=SEQ, multi_query=True, resid_pdrop=0.0,
                                                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
                    "tokens"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**SMALL, **LM, "num_key_value_heads": 4,
                                                           "qk_layernorm": True}, "tokens"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                                      "num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "layer_types": ["full_attention"] * 2}, "tokens"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                                         "num_local_experts": 4, "num_experts_per_tok": 1,
                                                         "intermediate_size_mlp": 128, "interleave_moe_layer_step": 1},
               "tokens"),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                         num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2,
                                                         chunk_size=8, use_cache=False), "tokens"),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "kv_channels": 16,
                                                     "num_local_experts": 4, "num_experts_per_tok": 2}, "tokens"),
    "zamba": ("ZambaConfig", "ZambaForCausalLM", {**SMALL, **LM, "num_hidden_layers": 4, "num_key_value_heads": 4,
                                                  "attention_head_dim": 32, "n_mamba_heads": 4, "mamba_d_state": 8,
                                                  "mamba_dt_rank": 4, "layer_types": ["mamba", "hybrid"] * 2},
              "tokens"),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                      state_size=16, expand=2, time_step_rank=4, use_cache=False),
              "tokens"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                                               "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                                               "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                                               "num_experts": 4, "num_experts_per_tok": 2,
                                                               "moe_intermediate_size": 64,
                                                               "shared_expert_intermediate_size": 64,
                                                               "layer_types": ["linear_attention", "full_attention"]},
                   "tokens"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                                            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                                            "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                                            "layer_types": ["linear_attention", "full_attention"]},
                "tokens"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                                            "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
                                                            "mamba_n_groups": 1, "mamba_d_state": 16,
                                                            "mamba_chunk_size": 8}, "tokens"),
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 2, "head_dim": 16,
                                               "tie_word_embeddings": False, "layer_types": ["conv", "full_attention"]},
             "tokens"),
    "rwkv": ("RwkvConfig", "RwkvForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, attention_hidden_size=64,
                                                   intermediate_size=256, num_hidden_layers=2, context_length=SEQ,
                                                   use_cache=False), "tokens"),  # its FFN 4x its width, as RWKV's
    "dory": ("DoryConfig", "DoryForCausalLM", {**SMALL, **LM, "num_hidden_layers": 3, "num_key_value_heads": 2,
                                               "head_dim": 16, "n_input_layers": 1, "n_recurrent_layers": 1,
                                               "n_output_layers": 1, "sliding_window": SEQ}, "tokens"),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", {**SMALL, **LM, "num_key_value_heads": 4, "moe_intermediate_size": 64,
                                                "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
                                                "qk_rope_head_dim": 8, "v_head_dim": 16, "index_n_heads": 2,
                                                "index_head_dim": 16, "index_topk": 8, "n_routed_experts": 4,
                                                "num_experts_per_tok": 2, "layer_types": ["indexed_attention"] * 2,
                                                "indexer_types": ["full", "shared"]}, "tokens"),
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", {**SMALL, **LM, "num_hidden_layers": 1, "head_dim": 16,
                                                         "H_cycles": 2, "L_cycles": 2, "L_bp_cycles": [1]}, "tokens"),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {**SMALL, **LM, "num_attention_heads": 8,
                                                              "num_key_value_heads": 4}, "tokens"),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, n_head=4, n_layer=2,
                                                      use_cache=False), "tokens"),
    "xlm": ("XLMConfig", "XLMWithLMHeadModel", dict(vocab_size=VOCAB, emb_dim=64, n_heads=4, n_layers=2,
                                                    max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
                                                    causal=True), "tokens"),
    "roformer": ("RoFormerConfig", "RoFormerForCausalLM", {**SMALL, "max_position_embeddings": SEQ, "is_decoder": True,
                                                           "use_cache": False, "pad_token_id": 0}, "tokens"),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {**SMALL, "embedding_size": 32, "max_position_embeddings": SEQ,
                                                      "pad_token_id": 0}, "tokens"),
    "bert": ("BertConfig", "BertForMaskedLM", {**SMALL, "max_position_embeddings": SEQ, "pad_token_id": 0}, "tokens"),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                                           intermediate_size=128, image_size=16, patch_size=4,
                                                           num_labels=10), "pixels"),
}


# models written in plain PyTorch (tests/plain_models.py): name -> (builder, input kind)
PLAIN = {"plain: nanoGPT": ("nanogpt", "tokens"), "plain: MHA variants": ("mha_variants", "tokens"),
         "plain: llama3": ("llama3", "tokens"), "plain: nn.TransformerEncoder LM": ("encoder_lm", "tokens"),
         "plain: nn.Transformer enc-dec": ("seq2seq", "tokens"), "plain: ViT (Conv2d patches)": ("vit", "images"),
         "plain: gated scan (logcumsumexp & cumprod)": ("scan_lm", "tokens"),
         "plain: widening h-4h-16h-h": ("widening", "tokens"),
         "plain: attention as a ModuleList of heads": ("head_list", "tokens"),
         "plain: MoE as a loop over experts (rows by torch.where)": ("loop_moe", "tokens"),
         "plain: a loop over heads sharing one matrix": ("head_loop", "tokens")}


def _plain_model(family: str):
    """(model, example input) of a PLAIN row."""
    import torch

    from tests import plain_models

    builder, kind = PLAIN[family]
    model = getattr(plain_models, builder)()
    if kind == "images":
        return model, torch.zeros(BATCH, 3, plain_models.IMAGE, plain_models.IMAGE)
    return model, torch.zeros(BATCH, plain_models.SEQ, dtype=torch.long)


# the sizes --own-sizes leaves to each config's defaults (layer counts, vocabulary, positions and layout stay as above)
SIZES = {"hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
         "num_attention_heads", "num_key_value_heads", "num_kv_heads", "head_dim", "attention_hidden_size", "kv_lora_rank",
         "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
         "n_head", "n_heads", "emb_dim", "embedding_size", "n_inner", "n_embd", "ffn_dim", "num_heads",
         "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
         "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_d_state", "state_size", "expand", "time_step_rank",
         "conv_kernel", "n_groups", "intermediate_ratio"}


def measure(family: str, tp: int = 2, own_sizes: bool = False) -> tuple[float, list[tuple[str, str]]]:
    """(sharded fraction on tp, replicated (module, reason) pairs) for `family` at `tp`; `own_sizes`: a transformers
    family at its config's default sizes (SIZES left out of the small config)."""
    def build():
        import torch
        import transformers

        if family in PLAIN:
            return _plain_model(family)
        cfg_cls, model_cls, kwargs, kind = FAMILIES[family]
        if own_sizes:
            kwargs = {k: v for k, v in kwargs.items() if k not in SIZES}
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
        return model, (torch.zeros(BATCH, 3, 16, 16) if kind == "pixels" else torch.zeros(BATCH, SEQ, dtype=torch.long))
    return coverage_of(build, tp)


def coverage_of(build, tp: int) -> tuple[float, list[tuple[str, str]]]:
    """(sharded fraction on tp, replicated (module, reason) pairs) of the model `build()` returns with its example
    input, compiled for rank 0 at `tp` on fake tensors (built inside the fake mode: no weights), or, for a model that
    cannot be (ViT reads a tensor's value while tracing; HY-V4's init swaps its parameters), on real ones. Also benchmarks/tp_sweep.py's measure."""
    from meshc.compiler.compile import compile_rank
    from meshc.compiler.ir import torch_compat as compat
    from meshc.compiler.ir.coverage import coverage
    from meshc.compiler.ir.mesh_spec import MeshSpec
    from meshc.compiler.ir.plan import Plan

    plan = Plan(trace="non-strict", check_trace=False)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, x = build()
            return compile_rank(model, (x,), {}, mesh=MeshSpec({"tp": tp}), plan=plan, rank=0)[0]

    try:
        with compat.fake_tensor_mode():
            result = run()
    except Exception:  # ViT reads a size as a Python number, HY-V4's init cannot swap a fake parameter: built and
        result = run()  # compiled on real weights instead (the configs are tiny); its own error if that fails too
    cov = coverage(result.program.params, {"tp": tp}, result.program.tp_why)
    return cov.fractions["tp"], cov.replicated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated families (default: all)")
    p.add_argument("--own-sizes", action="store_true", help="transformers families at their configs' default sizes")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n] or list(FAMILIES) + ([] if args.own_sizes else list(PLAIN))
    print(f"| family ({'its own sizes' if args.own_sizes else 'small config'}) | sharded at tp={args.tp} | "
          "replicated modules: why |")
    print("|---|---|---|")
    for name in names:
        try:
            frac, replicated = measure(name, args.tp, args.own_sizes)
        except Exception as e:  # a family that does not compile is a row of the table, not the end of it
            print(f"| {name} | error | {type(e).__name__}: {str(e).splitlines()[0][:160]} |", flush=True)
            continue
        reasons = sorted({f"{_short(m)}: {r}" for m, r in replicated})
        print(f"| {name} | {frac:.2f} | {'; '.join(reasons)[:400] or '-'} |", flush=True)


def _short(module: str) -> str:
    """model.layers.0.self_attn.qkv_proj -> layers.*.self_attn.qkv_proj: one line per kind of module."""
    import re

    return re.sub(r"^.*?\.?(\w+)\.\d+\.", r"\1.*.", module)


if __name__ == "__main__":
    main()
