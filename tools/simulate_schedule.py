"""The Gluon backward's grid as the GPU's block scheduler would run it, in each program order
of kernels.gluon.common.grid_order (ORDER 0, 1, and groups of 2-16 heads): programs dispatched in launch
order to the first SM that frees up (greedy list scheduling), each taking steps * s + o
microseconds (its walk's steps as kernels.gluon.bwd._walk_bounds counts them; s and o from
the fit in docs/journal/perf-journal.md). Prints the makespan of each order and the ideal (every SM
busy to the end). Memory is not modelled: larger groups of heads read more distinct Q, dO
and dQ rows at a time (L2).

    python tools/simulate_schedule.py [--seqlen 8192] [--heads 32] [--sms 132]
"""
import argparse
import heapq

BLOCK_M, BLOCK_N = 64, 128


def steps(n, N, window):
    """Key block n's walk: the 64-row query blocks that see some of its keys (causal, and a
    window of `window` keys to the left where given)."""
    hi = N if window is None else min(N, n * BLOCK_N + BLOCK_N - 1 + window)
    return max(-(-hi // BLOCK_M) - n * BLOCK_N // BLOCK_M, 0)


def order(kind, nb, P, N, window):
    """(n, bh) in launch order, as grid_order maps the launch-linear id for ORDER `kind`."""
    out = []
    for L in range(nb * P):
        if kind == 0:
            out.append((L % nb, L // nb))
        elif kind == 1:
            whole = min(max((N - window) // BLOCK_N, 0), nb) if window else nb
            r = L - P * whole
            out.append((L % whole, L // whole) if L < P * whole else (whole + r // P, r % P))
        else:
            g, r = divmod(L, kind * nb)
            width = min(P - kind * g, kind)
            out.append((r // width, kind * g + r % width))
    return out


def makespan(progs, cost, sms):
    free = [0.0] * sms
    end = 0.0
    for n, _ in progs:
        t = heapq.heappop(free) + cost(n)
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32, help="batch * KV heads")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--step-us", type=float, default=2.36)
    p.add_argument("--program-us", type=float, default=4.5)
    p.add_argument("--forward", action="store_true",
                   help="the causal forward instead: 128-row query blocks, query block m "
                        "walking m + 1 key blocks, taken last first (HEAVY_FIRST); the "
                        "forward's fit (1.52 us a step, 7.1 a program) unless given")
    args = p.parse_args()
    if args.forward:
        forward(args)
        return
    N, P = args.seqlen, args.heads
    nb = N // BLOCK_N
    orders = (0, 1, 2, 4, 8, 16)
    print("ORDER " + " / ".join(map(str, orders)) + " (makespan us)")
    for name, window in (("causal", None), ("window 1024", 1023)):
        def cost(n):
            return steps(n, N, window) * args.step_us + args.program_us
        ideal = sum(cost(n) for n in range(nb)) * P / args.sms
        spans = [makespan(order(k, nb, P, N, window), cost, args.sms) for k in orders]
        print(f"{name}: " + " / ".join(f"{s:.0f}" for s in spans) + f"; ideal {ideal:.0f}")


def forward(args):
    """The causal forward's grid in each order (grid_order's index i is query block
    nb - 1 - i: HEAVY_FIRST)."""
    N, P = args.seqlen, args.heads
    nb = N // BLOCK_N
    step = 1.52 if args.step_us == 2.36 else args.step_us
    prog = 7.1 if args.program_us == 4.5 else args.program_us

    def cost(i):
        return (nb - i) * step + prog
    orders = (0, 2, 4, 8, 16)
    ideal = sum(cost(i) for i in range(nb)) * P / args.sms
    spans = [makespan(order(k, nb, P, N, None), cost, args.sms) for k in orders]
    print("ORDER " + " / ".join(map(str, orders)) + " (makespan us)")
    print("causal forward: " + " / ".join(f"{s:.0f}" for s in spans) + f"; ideal {ideal:.0f}")


if __name__ == "__main__":
    main()
