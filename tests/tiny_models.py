"""Tiny random-weight chat models of every architecture the engine runs, built with transformers.

Each keeps its real configuration's layout (heads, key/value heads and head size, rope settings,
biases, norms, sliding-window pattern, tied or separate output layer) with a few layers, a small
hidden size and a small byte-level tokenizer, so a test builds and runs one in a
second or two without any download. The weights are random but shaped so that attention matters
(a position or masking bug changes the tokens) and the end-of-turn token is never the greedy choice
(answers run to their full length, past the positions a test wants to reach).
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = (
    "the of and to in is was for on are with as his they at be this from have or by one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many some "
    "so these would other into has more her two like him see time could no make than first been its who now "
    "people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much go good new write our me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help "
    "put years different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while might next sound "
    "below saw something thought both few those always looked show large often together asked house world going "
    "want school important until form food keep children feet land side without boy once animals life enough "
    "took sometimes four head above kind began almost live page got earth need far hand high year mother light "
    "parts country father let night following picture being study second eyes soon times story boys since white "
    "days ever paper hard near sentence better best across during today others however sure means knew its try "
    "told young miles sun ways thing whole hear example heard several change answer room sea against top turned "
    "learn point city play toward five using himself usually"
).split()
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>"]
EOS = 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
VOCAB = 512  # a byte-level BPE trained on WORDS (words of 1-3 tokens), as real chat models' tokenizers are


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE of VOCAB tokens trained on WORDS, with a ChatML-like chat template. (Byte-level
    because transformers loads Qwen2's tokenizer class for a qwen2 folder, whatever the folder says.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS + ["system", "user", "assistant"])] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<pad>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)


def _llama_3_2(**extra):  # Llama 3.2 1B: 32 heads, 8 key/value heads of 64, Llama 3 rope scaling, tied
    return {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "hidden_size": 256, "intermediate_size": 512, "rope_theta": 500000.0, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, **extra}


# name -> config fields (model_type first); a few layers each, everything else as the real model has it
ARCHITECTURES: dict[str, dict] = {
    "llama": _llama_3_2(),
    # Mistral 7B v0.1: 32 heads, 8 key/value heads of 128, a sliding window (4096 there, 24 here), separate output
    "mistral": {"model_type": "mistral", "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "hidden_size": 256, "intermediate_size": 512, "rope_theta": 10000.0, "sliding_window": 24,
                "tie_word_embeddings": False, "max_position_embeddings": 32768},
    # SmolLM3 3B: 16 heads, 4 key/value heads of 128, every 4th layer without rotation, tied
    "smollm3": {"model_type": "smollm3", "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "rope_theta": 5000000.0,
                "no_rope_layer_interval": 4, "tie_word_embeddings": True, "max_position_embeddings": 65536},
    # Qwen2.5 0.5B: 14 heads, 2 key/value heads of 64, q/k/v biases, tied
    "qwen2": {"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
              "intermediate_size": 256, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    # Qwen3 0.6B: 16 heads, 8 key/value heads of 128, per-head q/k RMS norms, tied
    "qwen3": {"model_type": "qwen3", "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "hidden_size": 128, "intermediate_size": 384, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6},
    # Gemma 3 1B: 4 heads, 1 key/value head of 256, 5 sliding-window layers (local rope base) per full one
    "gemma3_text": {"model_type": "gemma3_text", "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 6, "sliding_window": 24,
                    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    # Gemma 2 2B: 8 heads, 4 key/value heads of 256, sliding and full layers alternating, soft-capping
    "gemma2": {"model_type": "gemma2", "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "sliding_window": 24,
               "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "rope_theta": 10000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6},
    # Phi-3 mini 4k: 32 heads of 96 (no grouping), fused q/k/v and gate/up, a sliding window, separate output
    "phi3": {"model_type": "phi3", "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 384,
             "intermediate_size": 512, "rope_theta": 10000.0, "sliding_window": 40, "tie_word_embeddings": False,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
}

# Variants: settings some real configurations have and the ones above do not
VARIANTS: dict[str, dict] = {
    # soft-capping that bites (caps near the scores' size), and a query scale other than 1 / sqrt(head_dim)
    # (Gemma 2 9B, Gemma 3 27B: query_pre_attn_scalar = hidden / heads); Gemma 3 ignores the attention cap
    "gemma2-capped": {**ARCHITECTURES["gemma2"], "attn_logit_softcapping": 2.0,
                      "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 96},
    "gemma3_text-capped": {**ARCHITECTURES["gemma3_text"], "attn_logit_softcapping": 2.0,
                           "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 96},
}

# Variants for rope scaling past the original context (small originals make it cheap to pass them)
LONG_CONTEXT: dict[str, dict] = {
    "llama3-rope": _llama_3_2(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                              max_position_embeddings=256),
    # Qwen2.5's long-context recipe: YaRN by 4 on its original context (32768 there, 48 here)
    "qwen2-yarn": {**ARCHITECTURES["qwen2"], "max_position_embeddings": 48,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}},
    # Phi-4 mini: 24 heads, 8 key/value heads of 128, three quarters of each head rotated, longrope
    "phi4-mini-longrope": {"model_type": "phi3", "num_attention_heads": 6, "num_key_value_heads": 2,
                           "hidden_size": 768, "intermediate_size": 256, "tie_word_embeddings": True,
                           "partial_rotary_factor": 0.75, "max_position_embeddings": 256,
                           "original_max_position_embeddings": 48,
                           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
                                            "long_factor": [1.0 + i / 6 for i in range(48)]}},
}


def build(folder: Path, fields: dict, layers: int = 2, seed: int = 0) -> Path:
    """A tiny model with ``fields`` (a config's model_type and settings), its tokenizer and generation
    config, saved as safetensors in ``folder``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    model_type = fields.pop("model_type")
    fields.setdefault("num_hidden_layers", layers)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1, pad_token_id=3,
                                  initializer_range=0.08, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gemma = "gemma" in model_type
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms away from their start, so that their weights count
                # Gemma's norms multiply by 1 + w; its sublayers' outputs are weighed up (x2) as trained
                # models' are, else the scaled, tied embedding makes the model repeat its input token
                start = (1.0 if "post_" in name or "pre_feedforward" in name else 0.0) if gemma else 1.0
                p.copy_(start + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
        if gemma:  # multiplied by sqrt(hidden) on the way in
            model.model.embed_tokens.weight.normal_(0.0, 0.02)
        model.lm_head.weight[EOS] = 0.0  # logit 0, far below the best: answers never end early
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def prompt(i: int, words: int = 12) -> str:
    """A different user message for each ``i``, of about ``words`` words."""
    return " ".join(WORDS[(i * 37 + j * (i + 3)) % len(WORDS)] for j in range(words))
