"""Ring attention on a sequence sharded over processes: a causal self-attention layer
(qkv projection, rotary positions, attention, output projection) trained for a few steps
with its activations split along the sequence, checked against the same layer run whole.

    python examples/ring_attention.py --world 2              # gloo on the CPU (interpreter)
    python examples/ring_attention.py --world 2 --seqlen 65536 --dim 2048   # NCCL, 2+ GPUs

On the CPU set TRITON_INTERPRET=1 (the script does when no GPU is present) and keep the
sizes small. Each rank holds its zigzag shard of the tokens; the gradients of the shared
weights are all-reduced as in data parallelism.
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashtriton import flash_attention  # noqa: E402
from flashtriton import distributed as ring  # noqa: E402


class Layer(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, positions, attention):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        q, k = rotate(q, positions), rotate(k, positions)
        return self.out(attention(q, k, v).reshape(B, T, C))


def rotate(x, positions):
    """Rotary embedding (GPT-NeoX halves) at the tokens' global positions."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None] * freq                           # (T, half)
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


def run(rank, world, init_file, args, results):
    cuda = torch.cuda.is_available()
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same weights and data on every rank
    layer = Layer(args.dim, args.heads).to(device, dtype)
    x = torch.randn(1, args.seqlen, args.dim, device=device, dtype=dtype)
    whole = Layer(args.dim, args.heads).to(device, dtype)
    whole.load_state_dict(layer.state_dict())

    x_local = ring.shard(x, rank, world)
    pos_local = ring.positions(x_local.shape[1], rank, world, device=device)
    out_local = layer(x_local, pos_local, lambda q, k, v: ring.ring_attention(q, k, v,
                                                                              causal=True))
    out_local.float().square().mean().backward()
    for p in layer.parameters():  # the loss is a mean over the shards: average the grads
        dist.all_reduce(p.grad)
        p.grad /= world

    pos = torch.arange(args.seqlen, device=device)
    ref = whole(x, pos, lambda q, k, v: flash_attention(q, k, v, causal=True))
    ref.float().square().mean().backward()
    out_err = float((out_local.float() - ring.shard(ref, rank, world).float()).norm()
                    / ring.shard(ref, rank, world).float().norm())
    grad_err = max(float((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm())
                   for a, b in zip(layer.parameters(), whole.parameters()))
    results[rank] = (out_err, grad_err)
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs (one per rank, NCCL); "
                         f"this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run, args=(args.world, os.path.join(tmp, "init"), args, results),
                 nprocs=args.world, join=True)
        errors = dict(results)
    for rank in sorted(errors):
        print(f"rank {rank}: output rel. error {errors[rank][0]:.2e}, "
              f"weight-gradient rel. error {errors[rank][1]:.2e} (vs the whole sequence)")
    return errors


if __name__ == "__main__":
    main()
