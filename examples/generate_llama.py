"""Greedy generation with a randomly initialised transformers Llama, attention through
flashtriton's paged KV cache (prefill and decode), checked against transformers' generate().

    python examples/generate_llama.py            # GPU if there is one, else the interpreter

The model's weights are used as they are; only attention goes through
``PagedKVCache.attend`` (rotary applied by the kernel wrapper, flash-attn's rule). No
downloads: the model is built from a config.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashtriton.decode import PagedKVCache  # noqa: E402


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, page_size=16, num_pages=256):
    """Greedy decoding of (batch, prompt_len) input_ids; returns (batch, prompt + new)."""
    cfg = model.config
    layers = model.model.layers
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    device, dtype = input_ids.device, model.dtype
    caches = [PagedKVCache(num_pages, page_size, cfg.num_key_value_heads, head_dim, dtype, device)
              for _ in layers]
    seqs = list(range(input_ids.shape[0]))
    for cache in caches:
        for s in seqs:
            cache.add(s)
    # rotary tables (positions x head_dim / 2), GPT-NeoX halves layout as in transformers
    positions = torch.arange(cfg.max_position_embeddings, device=device)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, device=device, dtype=dtype), positions)
    cos, sin = cos[0, :, : head_dim // 2].float(), sin[0, :, : head_dim // 2].float()

    tokens = input_ids
    step_ids = input_ids
    for _ in range(max_new_tokens):
        h = model.model.embed_tokens(step_ids)
        B, T, _ = h.shape
        for layer, cache in zip(layers, caches):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(B, T, cfg.num_attention_heads, head_dim)
            k = a.k_proj(x).view(B, T, cfg.num_key_value_heads, head_dim)
            v = a.v_proj(x).view(B, T, cfg.num_key_value_heads, head_dim)
            o = cache.attend(q, k, v, seqs, causal=True, rotary_cos=cos, rotary_sin=sin,
                             rotary_interleaved=False)
            h = h + a.o_proj(o.reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(model.model.norm(h[:, -1]))
        step_ids = logits.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, step_ids], dim=1)
    return tokens


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama().to(device)
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), device=device,
                           generator=torch.Generator(device).manual_seed(1))
    ours = generate(model, prompt, max_new_tokens=8)
    ref = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    print("flashtriton :", ours.tolist())
    print("transformers:", ref.tolist())
    same = torch.equal(ours, ref)
    print("same tokens:", same)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
