"""Ring attention: one sequence sharded over the ranks of a torch.distributed group.

Each rank holds a shard of q, k and v along the sequence. K/V shards travel round
the ring (batched isend/irecv to the next rank, started before the local kernels
run so the transfer overlaps them); each rank attends its queries to every K/V
shard in turn and merges the partial results by their log-sum-exps. The backward
sends K/V round the ring again, with fp32 dK/dV accumulators one step behind, and
recomputes each block from the final output and LSE (no N x N buffer, no full
sequence on any rank: memory per rank is O(seqlen / world_size)).

Layouts of the shards (``layout=``):
  "contiguous": rank r holds tokens [r n, (r + 1) n) of the sequence.
  "zigzag":     the sequence is cut into 2 W chunks of n / 2 tokens and rank r
                holds chunks r and 2 W - 1 - r, so under a causal mask every rank
                does the same work (the contiguous layout leaves rank 0 almost idle).
``shard`` / ``unshard`` convert; ``positions`` gives the global token positions of
a shard (for rotary embeddings).

Masks are the global ones: causal and sliding windows (flash-attn's definition)
apply to global positions; each (query chunk, key chunk) pair is skipped, run
without a mask, or run with the window shifted to the chunks' offsets.
"""

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from . import launch
from .api import AttentionOutput
from .validation import (check_deterministic, check_flag, check_qkv, check_scale,
                         check_softcap, check_window, unit_last)
from .launch import Variant

LAYOUTS = ("contiguous", "zigzag")


class _Segment(NamedTuple):
    local: int   # first row in the shard
    length: int
    start: int   # first position in the whole sequence


def _segments(rank: int, world: int, n: int, layout: str) -> List[_Segment]:
    if layout == "contiguous":
        return [_Segment(0, n, rank * n)]
    c = n // 2
    return [_Segment(0, c, rank * c), _Segment(c, c, (2 * world - 1 - rank) * c)]


NONE, PARTIAL, FULL = 0, 1, 2


def _visibility(qs: _Segment, ks: _Segment, left: int, right: int) -> int:
    """Whether no, some or every query of qs sees every key of ks (global positions)."""
    dmin = ks.start - (qs.start + qs.length - 1)  # range of key position - query position
    dmax = ks.start + ks.length - 1 - qs.start
    lo = -left if left >= 0 else -float("inf")
    hi = right if right >= 0 else float("inf")
    if dmax < lo or dmin > hi:
        return NONE
    return FULL if (dmin >= lo and dmax <= hi) else PARTIAL


class _Block(NamedTuple):
    q: slice
    k: slice
    variant: Variant


def _plan(q_segs, k_segs, base: Variant, left: int, right: int) -> List[_Block]:
    """The kernel launches of one ring step: a key segment that every query sees whole
    (or a query segment that sees every key) runs as one launch over the whole shard."""
    vis = [[_visibility(qs, ks, left, right) for ks in k_segs] for qs in q_segs]
    whole_q = slice(q_segs[0].local, q_segs[-1].local + q_segs[-1].length)
    whole_k = slice(k_segs[0].local, k_segs[-1].local + k_segs[-1].length)
    todo = {(i, j) for i in range(len(q_segs)) for j in range(len(k_segs)) if vis[i][j] != NONE}
    blocks = []
    if all(vis[i][j] == FULL for i in range(len(q_segs)) for j in range(len(k_segs))):
        return [_Block(whole_q, whole_k, base)]
    for j, ks in enumerate(k_segs):
        if len(q_segs) > 1 and all(vis[i][j] == FULL for i in range(len(q_segs))):
            blocks.append(_Block(whole_q, slice(ks.local, ks.local + ks.length), base))
            todo -= {(i, j) for i in range(len(q_segs))}
    for i, qs in enumerate(q_segs):
        if len(k_segs) > 1 and all((i, j) in todo and vis[i][j] == FULL
                                   for j in range(len(k_segs))):
            blocks.append(_Block(slice(qs.local, qs.local + qs.length), whole_k, base))
            todo -= {(i, j) for j in range(len(k_segs))}
    for i, j in sorted(todo):
        qs, ks = q_segs[i], k_segs[j]
        variant = base
        if vis[i][j] == PARTIAL:  # the kernel's diagonal is SK - SQ; the chunks' is their offset
            offset = (qs.start - ks.start) - (ks.length - qs.length)
            variant = base._replace(window_left=left, window_right=right, diag_offset=offset)
        blocks.append(_Block(slice(qs.local, qs.local + qs.length),
                             slice(ks.local, ks.local + ks.length), variant))
    return blocks


class _Ring(NamedTuple):
    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    send_to: int  # global ranks
    recv_from: int

    @staticmethod
    def of(group) -> "_Ring":
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        return _Ring(group, rank, world, to_global((rank + 1) % world),
                     to_global((rank - 1) % world))

    def exchange(self, tensors):
        """Start sending ``tensors`` to the next rank and receiving the previous rank's
        into new buffers; returns (buffers, pending): ``_wait(pending)`` before reading
        the buffers. Pending holds the sent tensors too: freeing one in flight corrupts it."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.recv_from, self.group) for b in bufs]
        return bufs, (dist.batch_isend_irecv(ops), list(tensors))


def _wait(pending) -> None:
    if pending:
        for request in pending[0]:
            request.wait()


def _merge(out_acc, lse_acc, out, lse) -> None:
    """Fold a partial result (out, lse) into the fp32 accumulators, in place."""
    new = torch.logaddexp(lse_acc, lse)
    seen = torch.isfinite(new)  # rows that no key has reached yet stay (0, -inf)
    w_old = torch.where(seen, torch.exp(lse_acc - new), 0.0).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(seen, torch.exp(lse - new), 0.0).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_old).add_(out.float() * w_new)
    lse_acc.copy_(new)


def _ring_forward(q, k, v, ring: _Ring, layout, base: Variant, left, right):
    B, n, H, D = q.shape
    q_segs = _segments(ring.rank, ring.world, n, layout)
    out_acc = q.new_zeros((B, n, H, D), dtype=torch.float32)
    lse_acc = q.new_full((B, H, n), float("-inf"), dtype=torch.float32)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, requests = ring.exchange(kv)
        src = (ring.rank - step) % ring.world
        for blk in _plan(q_segs, _segments(src, ring.world, n, layout), base, left, right):
            o, l = launch.attention_forward(q[:, blk.q], kv[0][:, blk.k], kv[1][:, blk.k],
                                            blk.variant)
            _merge(out_acc[:, blk.q], lse_acc[:, :, blk.q], o, l)
        if step + 1 < ring.world:
            _wait(requests)
            kv = nxt
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, layout, base: Variant, left, right):
    n = q.shape[1]
    q_segs = _segments(ring.rank, ring.world, n, layout)
    dq_acc = torch.zeros_like(q, dtype=torch.float32)
    kv = [k.contiguous(), v.contiguous()]
    dkv, dkv_requests = None, None  # the accumulators of the K/V shard held now, in transit
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, requests = ring.exchange(kv)
        src = (ring.rank - step) % ring.world
        dk = torch.zeros_like(kv[0], dtype=torch.float32)
        dv = torch.zeros_like(kv[1], dtype=torch.float32)
        for blk in _plan(q_segs, _segments(src, ring.world, n, layout), base, left, right):
            dqb, dkb, dvb, _ = launch.attention_backward(
                dout[:, blk.q], q[:, blk.q], kv[0][:, blk.k], kv[1][:, blk.k], out[:, blk.q],
                lse[:, :, blk.q], blk.variant)
            dq_acc[:, blk.q] += dqb
            dk[:, blk.k] += dkb
            dv[:, blk.k] += dvb
        _wait(dkv_requests)  # the previous ranks' sums for this K/V shard
        if dkv is not None:
            dk += dkv[0]
            dv += dkv[1]
        dkv, dkv_requests = ring.exchange([dk, dv])
        if step + 1 < ring.world:
            _wait(requests)
            kv = nxt
    _wait(dkv_requests)  # after a full turn each shard's sums are back with its owner
    return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, base, left, right):
        out, lse = _ring_forward(q, k, v, ring, layout, base, left, right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (ring, layout, base, left, right)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(unit_last(dout), q, k, v, out, lse, *ctx.options)
        return dq, dk, dv, None, None, None, None, None


def _check_ring(q, k, v, group, layout) -> _Ring:
    check_qkv(q, k, v)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring attention needs torch.distributed: call "
                         "torch.distributed.init_process_group first (nccl on GPUs, gloo on CPU)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: q and k "
                         f"shards must be equally long; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank: the local seqlen "
                         f"must be even, got {q.shape[1]}")
    return _Ring.of(group)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: Optional[dist.ProcessGroup] = None, *, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                   softcap: float = 0.0, layout: str = "zigzag", return_lse: bool = False,
                   deterministic: bool = False):
    """Attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
    headdim), every rank's shard equally long and laid out by ``layout`` ("zigzag",
    the default, balances causal work; "contiguous"). causal / window_size / softcap /
    deterministic as in ``flashtriton.flash_attention``, on global positions (the ring's
    own sums run in a fixed order). Returns the local
    output shard, or AttentionOutput(out, lse) with ``return_lse`` (lse: (batch,
    nheads, seqlen_local) float32). Differentiable in q, k and v; every rank must
    call it (and its backward) in the same order.
    """
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    deterministic = check_deterministic(deterministic)
    ring = _check_ring(q, k, v, group, layout)
    left, right = check_window(window_size)
    if causal:
        right = 0
    base = Variant(check_scale(softmax_scale, q.shape[-1]), softcap=check_softcap(softcap),
                   deterministic=deterministic)
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    out, lse = _RingAttention.apply(q, k, v, ring, layout, base, left, right)
    return AttentionOutput(out, lse) if return_lse else out


def _flash_attn_style(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, group, layout):
    return_attn_probs = check_flag("return_attn_probs", return_attn_probs)
    if dropout_p:
        raise ValueError("ring attention does not support dropout (dropout_p must be 0)")
    if alibi_slopes is not None:
        raise ValueError("ring attention does not support alibi_slopes")
    out, lse = ring_attention(q, k, v, group, causal=causal, softmax_scale=softmax_scale,
                              window_size=window_size, softcap=softcap, layout=layout,
                              return_lse=True, deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=False, group=None):
    """flash_attn_func's signature over contiguous shards (rank r holds tokens
    [r n, (r + 1) n)), plus ``group``. Dropout and ALiBi are not supported (ValueError).
    ``deterministic`` as in flash_attn_func (the ring's own sums run in a fixed order)."""
    return _flash_attn_style(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, group, "contiguous")


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False, group=None):
    """As ``ring_flash_attn_func``, over zigzag shards (``shard(x, ..., layout="zigzag")``)."""
    return _flash_attn_style(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, group, "zigzag")


def positions(seqlen_local: int, rank: int, world_size: int, layout: str = "zigzag",
              device=None) -> torch.Tensor:
    """Global positions (int64) of the tokens of rank's shard, e.g. for rotary embeddings."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    segs = _segments(rank, world_size, seqlen_local, layout)
    return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in segs])


def shard(x: torch.Tensor, rank: int, world_size: int, *, dim: int = 1,
          layout: str = "zigzag") -> torch.Tensor:
    """Rank's shard of the whole sequence ``x`` (sequence along ``dim``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if x.shape[dim] % parts:
        raise ValueError(f"the sequence ({x.shape[dim]} along dim {dim}) must divide into "
                         f"{parts} equal chunks for the {layout} layout over {world_size} ranks")
    chunks = x.chunk(parts, dim=dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim=dim)


def unshard(x_local: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *, dim: int = 1,
            layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's shard (an all-gather; not differentiable)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)
