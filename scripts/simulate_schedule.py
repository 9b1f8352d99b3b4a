import heapq
N, BN, BM = 8192, 128, 64
nb = N // BN
def cnt(n, win=1024):
    lo = n * BN; hi = min(N, n * BN + BN - 1 + win)
    return (hi - lo + BM - 1) // BM
step, o = 2.36, 4.5
heads = 32
def makespan(order, sms=132):
    free = [0.0] * sms
    heapq.heapify(free)
    end = 0
    for n in order:
        t = heapq.heappop(free)
        t += cnt(n) * step + o
        end = max(end, t)
        heapq.heappush(free, t)
    return end
default = [n for h in range(heads) for n in range(nb)]
longfirst = sorted(default, key=lambda n: -cnt(n))
total = sum(cnt(n) * step + o for n in default)
print("ideal", total / 132)
print("default", makespan(default))
print("long first", makespan(longfirst))
rev = [n for h in range(heads) for n in reversed(range(nb))]
print("reversed n", makespan(rev))
nmajor = [n for n in range(nb) for h in range(heads)]
print("n-major", makespan(nmajor))
# causal walks
def cnt_c(n):
    return (N - n * BN) // BM
def makespan2(order, f, sms=132):
    free = [0.0] * sms; heapq.heapify(free); end = 0
    for n in order:
        t = heapq.heappop(free) + f(n) * step + o; end = max(end, t); heapq.heappush(free, t)
    return end
print("causal default", makespan2(default, cnt_c), "n-major", makespan2(nmajor, cnt_c),
      "ideal", sum(cnt_c(n) * step + o for n in default) / 132)
for G in (1, 2, 4, 8, 16, 32):
    order = [n for g in range(heads // G) for n in range(nb) for h in range(G)]
    print(f"groups of {G} heads n-major: window {makespan(order):.1f} causal {makespan2(order, cnt_c):.1f}")
# the window: head-major for long programs, then the short ones of every head, longest first
tail = sorted([n for h in range(heads) for n in range(nb) if cnt(n) < 18], key=lambda n: -cnt(n))
order = [n for h in range(heads) for n in range(nb) if cnt(n) == 18] + tail
print("window long head-major, then short", makespan(order))
def trace(order, f, sms=132):
    free = [0.0] * sms; heapq.heapify(free); end = 0; starts = []
    for n in order:
        t = heapq.heappop(free); starts.append(t)
        t2 = t + f(n) * step + o; end = max(end, t2); heapq.heappush(free, t2)
    return starts, end
for G in (1, 2):
    order = [n for g in range(heads // G) for n in range(nb) for h in range(G)]
    s, e = trace(order, cnt_c)
    idx = len(order) - G * nb
    print(G, "last group's first start", s[idx], "end", e, "work of a head per SM", sum(cnt_c(n) * step + o for n in range(nb)) / 132)
for G in (1, 2, 4):
    nsorted = sorted(range(nb), key=lambda n: -cnt(n))
    order = [n for g in range(heads // G) for n in nsorted for h in range(G)]
    print(f"window G={G} sorted-n: {makespan(order):.1f}")
