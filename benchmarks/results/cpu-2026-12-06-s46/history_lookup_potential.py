"""Session 46: what a cross-request n-gram lookup would copy where a request's own lookup finds nothing,
over history_lookup_answers.py's answers in order."""

import collections
import json

data = json.load(open("/tmp/hist_data.json"))
B = 3


def latest(seq, key, end):
    # latest start s < end - len(key)... such that seq[s:s+n]==key and s+n < end (continuation exists)
    n = len(key)
    for s in range(end - n - 1, -1, -1):
        if seq[s : s + n] == key:
            return s
    return None


def own_draft(ctx):
    n = len(ctx)
    for size in (3, 2):
        if n <= size:
            continue
        key = ctx[n - size :]
        s = latest(ctx, key, n)
        if s is not None:
            f = s + size
            return ctx[f : min(f + B, n)]
    return []


class Hist:
    def __init__(self, sizes):
        self.sizes = sizes
        self.idx = {}
        self.buf = []

    def add(self, toks):
        base = len(self.buf)
        self.buf.extend(toks)
        self.buf.append(-1)
        for size in self.sizes:
            for s in range(0, len(toks) - size):
                self.idx[(size, tuple(toks[s : s + size]))] = base + s + size

    def draft(self, ctx):
        for size in self.sizes:
            if len(ctx) < size:
                continue
            f = self.idx.get((size, tuple(ctx[-size:])))
            if f is not None:
                out = []
                for t in self.buf[f : f + B]:
                    if t < 0:
                        break
                    out.append(t)
                return out
        return []


def acc(draft, truth):
    a = 0
    for d, t in zip(draft, truth, strict=False):
        if d != t:
            break
        a += 1
    return a


for sizes in [(4, 3), (5, 4, 3), (4, 3, 2), (6, 5, 4), (3, 2)]:
    h = Hist(sizes)
    st = collections.Counter()
    for d in data:
        p, a = d["prompt"], d["answer"]
        full = p + a
        t = 0
        while t < len(a):
            ctx = full[: len(p) + t]
            truth = a[t : t + B]
            od = own_draft(ctx)
            st["blocks"] += 1
            if od:
                st["own"] += 1
                st["own_acc"] += acc(od, truth)
                adv = acc(od, truth) + 1
            else:
                hd = h.draft(ctx)
                if hd:
                    st["hist"] += 1
                    st["hist_acc"] += acc(hd, truth)
                    adv = acc(hd, truth) + 1
                else:
                    adv = 1  # drafter: assume ~ average; advance 1 (conservative step)
            t += adv
        h.add(full)
    print(
        sizes,
        dict(st),
        "own acc/match %.2f" % (st["own_acc"] / max(st["own"], 1)),
        "hist share of blocks {:.3f} acc/match {:.2f}".format(
            st["hist"] / st["blocks"], st["hist_acc"] / max(st["hist"], 1)
        ),
    )
