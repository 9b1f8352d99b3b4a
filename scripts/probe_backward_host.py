"""Where the host time of a small backward goes (H200 investigation: autograd's backward of a
kept graph costs ~260 us more than `launch.attention_backward` called directly). One process:
the launcher alone on the main thread; the kept graph's backward, with the time spent inside
the launcher (and on which thread) measured by a wrapper; a trivial autograd.Function's
backward on the same tensors (the engine's own cost); SDPA's kept graph."""
import threading
import time
import torch
import torch.nn.functional as F
from flashtriton import flash_attention, launch
from flashtriton.bench import per_call_us

inside = {"us": 0.0, "calls": 0, "threads": set()}
real_backward = launch.attention_backward


def timed_backward(*args, **kwargs):
    t = time.perf_counter()
    try:
        return real_backward(*args, **kwargs)
    finally:
        inside["us"] += (time.perf_counter() - t) * 1e6
        inside["calls"] += 1
        inside["threads"].add(threading.current_thread().name)


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        return grad, None, None


q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
out = flash_attention(qg, kg, vg)
grad = torch.randn_like(out)
out.backward(grad, retain_graph=True)
lse = torch.zeros(1, 4, 128, device="cuda")
variant = launch.Variant(0.125)
rows = {"launcher alone (main thread)":
        lambda: launch.attention_backward(grad, q, k, v, out.detach(), lse, variant)}
ident = Identity.apply(qg, kg, vg)
rows["trivial Function, kept graph"] = lambda: ident.backward(grad, retain_graph=True)
ref = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2))
grad_ref = torch.randn_like(ref)
rows["sdpa, kept graph"] = lambda: ref.backward(grad_ref, retain_graph=True)
rows["flashtriton, kept graph"] = lambda: out.backward(grad, retain_graph=True)
for name, fn in rows.items():
    print(f"{name:32s} {per_call_us(fn, calls=200, repeats=5):7.1f} us/call", flush=True)
launch.attention_backward = timed_backward
for _ in range(10):
    out.backward(grad, retain_graph=True)
inside.update(us=0.0, calls=0)
total = per_call_us(lambda: out.backward(grad, retain_graph=True), calls=200, repeats=5)
print(f"{'kept graph, launcher inside':32s} {total:7.1f} us/call, of which in the launcher "
      f"{inside['us'] / inside['calls']:.1f} us (mean), threads {sorted(inside['threads'])}")
