"""Benchmarks and the demo: flashtriton against torch SDPA's backends, FlexAttention, flash-attn
and naive attention. Not imported by the library.

    python -m flashtriton.bench [--suites train gqa overhead coldstart decode] ...   # __main__
    python -m flashtriton.bench.variants ...    # masks and score mods against FlexAttention
    python -m flashtriton.bench.ring ...        # ring attention over the GPUs of one machine
    python -m flashtriton.bench.e2e ...         # transformers Llama training / generate, diffusion
    python -m flashtriton.bench.tune --out F    # the autotuner over a grid, as a tuning table
    python -m flashtriton.bench.demo            # the demo (CPU: Triton's interpreter)

This module is the registry: the providers (PROVIDERS, DECODE_PROVIDERS) and the suites and
their shapes (SUITES, shapes, DECODE_SHAPE). Every provider's result is checked against
flashtriton.reference (common.check, float32, chunked so that no score matrix passes 1 GB)
before its speed is measured; a row whose check fails reports the failure and no speed.
"""

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F


class Shape(NamedTuple):
    suite: str
    B: int
    H: int
    HKV: int
    N: int
    D: int
    causal: bool


# Training providers: fn(q, k, v, causal) on (B, H, N, D) tensors; k and v may have fewer
# heads (GQA). Differentiable.

def _naive(q, k, v, causal):
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def sdpa(backend: str) -> Callable:
    """torch SDPA restricted to one backend (SDPBackend's name)."""
    def run(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    return run


_FLEX = {}


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        # One compiled kernel per shape: lift the recompile limit (else dynamo falls back to
        # eager flex, which materialises S), and let backward run twice on one graph.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        torch._functorch.config.donated_buffer = False
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    key = (q.shape[-2], k.shape[-2], causal)
    if key not in _FLEX:
        _FLEX[key] = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[-2],
                                        k.shape[-2], device=q.device) if causal else None)
    return _FLEX["fn"](q, k, v, block_mask=_FLEX[key], enable_gqa=k.shape[1] != q.shape[1])


def _flash_attn(q, k, v, causal):
    from flash_attn import flash_attn_func  # only when installed
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


def _flashtriton(q, k, v, causal):
    from flashtriton import flash_attention
    return flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           causal=causal).transpose(1, 2)


PROVIDERS = {
    "flashtriton": _flashtriton,
    "sdpa_cudnn": sdpa("CUDNN_ATTENTION"),
    "flex": _flex,
    "sdpa_flash": sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": sdpa("EFFICIENT_ATTENTION"),
    "flash_attn": _flash_attn,
    "naive": _naive,
}


def available(name: str) -> bool:
    """Whether a provider can run here (flash-attn only where it is installed)."""
    if name != "flash_attn":
        return True
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


class DecodeInputs(NamedTuple):
    """One decoding step's inputs (decode.decode_inputs): q (B, 1, H, D); a contiguous cache
    k, v (B, N, HKV, D); the same keys and values in shuffled pages with their block table;
    cache_seqlens; and, for the fp8 providers, the same cache quantised (``fp8``: a
    DecodeInputs over float8_e4m3fn caches with its descales, or None)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    fp8: Optional["DecodeInputs"] = None
    k_descale: Optional[torch.Tensor] = None  # (B, HKV) float32 of an fp8 cache
    v_descale: Optional[torch.Tensor] = None


# Decoding providers: (make, output): make(DecodeInputs) is a step (no arguments, the call
# that is timed, as it was before this registry: flashtriton with return_lse=False returns
# its AttentionOutput, SDPA its (B, H, 1, D) tensor); output(result) is out (B, 1, H, D).

def _kvcache(paged: bool, batch_invariant: bool = False, fp8: bool = False):
    def make(x: DecodeInputs):
        from flashtriton.decode import attention_with_kvcache
        if fp8:
            x = x.fp8
        k, v, table = (x.k_pages, x.v_pages, x.table) if paged else (x.k, x.v, None)
        return lambda: attention_with_kvcache(x.q, k, v, cache_seqlens=x.lens, block_table=table,
                                              return_lse=False, batch_invariant=batch_invariant,
                                              k_descale=x.k_descale, v_descale=x.v_descale)
    return make


def _paged_varlen(x: DecodeInputs):
    """vLLM's call: flash_attn_varlen_func over the pages, one query a sequence."""
    from flashtriton.compat.flash_attn import flash_attn_varlen_func
    B, _, H, D = x.q.shape
    q = x.q.view(B, H, D)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    n = x.k.shape[1]
    return lambda: flash_attn_varlen_func(q, x.k_pages, x.v_pages, cu_q, None, 1, n,
                                          block_table=x.table, seqused_k=x.lens)


def _sdpa_decode(x: DecodeInputs):
    qs, ks, vs = x.q.transpose(1, 2), x.k.transpose(1, 2), x.v.transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)


DECODE_PROVIDERS = {
    "flashtriton": (_kvcache(paged=False), lambda r: r.out),
    "flashtriton_paged16": (_kvcache(paged=True), lambda r: r.out),
    "flashtriton_paged_varlen16": (_paged_varlen, lambda r: r.unsqueeze(1)),
    "flashtriton_batch_invariant": (_kvcache(paged=False, batch_invariant=True), lambda r: r.out),
    "flashtriton_fp8": (_kvcache(paged=False, fp8=True), lambda r: r.out),
    "flashtriton_paged16_fp8": (_kvcache(paged=True, fp8=True), lambda r: r.out),
    "sdpa": (_sdpa_decode, lambda r: r.transpose(1, 2)),
}
# Providers over the fp8 cache (DecodeInputs.fp8): checked against the reference over its
# dequantised values, one byte an element read.
FP8_DECODE_PROVIDERS = ("flashtriton_fp8", "flashtriton_paged16_fp8")


# The suites of python -m flashtriton.bench and their shapes.
SUITES = {
    "train": "batch * seqlen = --tokens (16K), nheads * headdim = --dmodel (2048), "
             "--dims x --seqlens x --causal",
    "gqa": "Llama-3 70B attention: batch 1, 64 query heads, 8 KV heads, headdim 128, causal, "
           "--gqa-seqlens",
    "overhead": "host time per call at a tiny shape (OVERHEAD_SHAPE, no CUDA graphs), each "
                "provider",
    "coldstart": "seconds of the first forward + backward of a new shape in a fresh process "
                 "with an empty Triton cache, and in a second process sharing that cache",
    "decode": "one query token over a KV cache (DECODE_SHAPE: 32 query heads, 8 KV heads, "
              "headdim 128, bf16, 16-token pages): --decode-batches x --decode-lens",
}
OVERHEAD_SHAPE = Shape("overhead", 1, 4, 4, 128, 64, False)
DECODE_SHAPE = dict(H=32, HKV=8, D=128, page=16)


def shapes(args) -> list:
    """The train and gqa suites' shapes for the CLI's arguments."""
    out = []
    if "train" in args.suites:
        out += [Shape("train", max(1, args.tokens // N), args.dmodel // D, args.dmodel // D, N, D,
                      bool(c)) for D in args.dims for N in args.seqlens for c in args.causal]
    if "gqa" in args.suites:
        out += [Shape("gqa", 1, 64, 8, N, 128, True) for N in args.gqa_seqlens]
    return out


def flops_fwd(B, H, SQ, SK, D, causal):
    """Forward FLOPs: 4 * B * H * SQ * SK * D, halved when causal."""
    f = 4 * B * H * SQ * SK * D
    return f / 2 if causal else f


def decode_bytes(B, N, HKV=8, D=128, itemsize=2):
    """Bytes of K and V one decoding step must read."""
    return 2 * B * N * HKV * D * itemsize
