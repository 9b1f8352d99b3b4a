"""Paged varlen (``flash_attn_varlen_func`` with ``block_table`` and ``seqused_k``, vLLM's call)
against flashtriton's contiguous kernels on the same keys.

    python -m flashtriton.bench.paged [--out DIR]

Batches (32 query heads, 8 KV heads, head dim 128, bf16, causal): prefill-heavy and mixed
ones (decode rows of one query beside prefill rows) against the contiguous varlen forward
over the same keys packed; decode-only ones against ``flash_attn_with_kvcache`` over the same
pages (and, for prefill batches of as many queries a sequence, flash_attn_with_kvcache over
the 16-token pages beside them). Pages of 16 (vLLM's) and 256 (flash-attn's) tokens,
shuffled in the pool. Each paged
call is first checked against flashtriton.reference (float32) on its first and last sequence's
first KV head group; a failed check reports no speed. Times: do_bench medians, the calls
alternated in 3 rounds (the median of each).
"""

import json
import os

import torch

from .common import TOLERANCE, add_out, alternated, failed, meta as run_meta, rel_err, script_args
from .common import parser as common_parser

H, HKV, D = 32, 8, 128
BATCHES = [  # (name, [(queries, keys)] a sequence)
    ("prefill 4 x 4K", [(4096, 4096)] * 4),
    ("chunked prefill 4 x 2K over 8K", [(2048, 8192)] * 4),
    ("mixed 2 x 2K + 62 decode over 4K", [(2048, 2048)] * 2 + [(1, 4096)] * 62),
    ("mixed 1 x 8K + 127 decode over 2K", [(8192, 8192)] + [(1, 2048)] * 127),
    ("decode 64 x 4K", [(1, 4096)] * 64),
    ("decode 8 x 32K", [(1, 32768)] * 8),
]
PAGES = (16, 256)


def paged(keys: torch.Tensor, lens, page: int, gen=None):
    """``keys`` (total, HKV, D) of sequences ``lens`` in a shuffled pool of ``page``-token pages:
    (pool (num_pages, page, HKV, D), block_table (batch, max_pages) int32)."""
    per_seq = [-(-n // page) for n in lens]
    order = torch.randperm(sum(per_seq), generator=gen).to(keys.device)
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=keys.device)
    pool = torch.zeros(sum(per_seq), page, *keys.shape[1:], dtype=keys.dtype,
                       device=keys.device)
    flat, at, row = pool.view(-1, *keys.shape[1:]), 0, 0
    for b, (n, p) in enumerate(zip(lens, per_seq)):
        table[b, :p] = order[at:at + p].to(torch.int32)
        pos = torch.arange(n, device=keys.device)
        flat[table[b, pos // page].long() * page + pos % page] = keys[row:row + n]
        at, row = at + p, row + n
    return pool, table


def _cu(lens, device):
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


def calls(seqs, device="cuda", gen=None):
    """{name: call} for one batch: the paged varlen calls, the contiguous varlen call, and
    for batches of as many queries a sequence flash_attn_with_kvcache over the 16-token pages;
    and the inputs."""
    from flashtriton.compat.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    lq, lk = [s[0] for s in seqs], [s[1] for s in seqs]
    q = torch.randn(sum(lq), H, D, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lk), HKV, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    out = {"contiguous varlen": lambda: flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)}
    for page in PAGES:
        (kp, table), (vp, _) = (paged(x, lk, page, torch.Generator().manual_seed(page))
                                for x in (k, v))
        out[f"paged {page}"] = (lambda kp=kp, vp=vp, table=table: flash_attn_varlen_func(
            q, kp, vp, cu_q, None, max(lq), max(lk), causal=True, block_table=table,
            seqused_k=used))
        if page == 16 and len(set(lq)) == 1:  # as many queries a sequence: a (B, SQ) batch
            q4 = q.view(len(lq), lq[0], H, D)
            out["flash_attn_with_kvcache 16"] = (
                lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(
                    q4, kp, vp, cache_seqlens=used, block_table=table, causal=True).view(q.shape))
    return out, (q, k, v, lq, lk)


def check(call, inputs) -> float:
    """Largest relative error of a call's output on its first and last sequence's first KV
    head group against the float32 reference over the same keys."""
    from flashtriton.reference import attention_reference
    q, k, v, lq, lk = inputs
    got, G, err = call(), H // HKV, 0.0
    cq, ck = _cu(lq, "cpu").tolist(), _cu(lk, "cpu").tolist()
    for b in (0, len(lq) - 1):
        if lq[b] == 0:
            continue
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref = attention_reference(q[None, qs, :G], k[None, ks, :1], v[None, ks, :1],
                                  causal=True, dtype=torch.float32)
        err = max(err, rel_err(got[None, qs, :G], ref.out))
    return err


def parser():
    p = common_parser("flashtriton.bench.paged", __doc__)
    add_out(p, "paged.jsonl")
    return p


def main(argv=None):
    import triton
    args = script_args(parser(), argv)
    meta, rows = run_meta(), []
    for name, seqs in BATCHES:
        torch.manual_seed(0)
        fns, inputs = calls(seqs)
        base = "flash_attn_with_kvcache 16" if max(inputs[3]) == 1 else "contiguous varlen"
        row = dict(meta, suite="paged-varlen", batch=name, H=H, HKV=HKV, D=D,
                   queries=sum(inputs[3]), keys=sum(inputs[4]), baseline=base)
        errs = {n: check(fn, inputs) for n, fn in fns.items()}
        row["rel_err"] = errs
        bad = {n: failed(e, TOLERANCE) for n, e in errs.items() if failed(e, TOLERANCE)}
        if bad:
            row["status"] = bad
            print(f"{name:36s} {bad}", flush=True)
        else:
            ms = {n: t for n, (t,) in alternated(lambda n: (triton.testing.do_bench(
                fns[n], warmup=25, rep=200, return_mode="median"),), list(fns)).items()}
            row.update(status="ok", ms=ms, ratio={n: ms[n] / ms[base] for n in ms})
            print(f"{name:36s} " + "  ".join(f"{n} {t * 1e3:8.1f} us ({t / ms[base]:.3f})"
                                             for n, t in ms.items()), flush=True)
        rows.append(row)
        fns = inputs = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "paged.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
