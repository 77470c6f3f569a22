"""Session 46: wall-clock ms a target forward in each piece of the model (linears, attention, rotary,
norms, LM head). `python forward_parts.py off|static [batch]`."""

import collections
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from e2e import _prompt_ids, bench_config

import dspark.kernels.ops as ops
import dspark.kernels.reference as ref
import dspark.runner.models.layers as layers
import dspark.runner.models.llama as llama
from dspark import LLM, SamplingParams

acc = collections.Counter()
cnt = collections.Counter()


def wrap(mod, name, label):
    f = getattr(mod, name)

    def g(*a, **k):
        s = time.perf_counter()
        r = f(*a, **k)
        acc[label] += time.perf_counter() - s
        cnt[label] += 1
        return r

    setattr(mod, name, g)


wrap(ops, "paged_attention", "attention")
wrap(ref, "_one_request_attention", "attn_one")
wrap(ops, "rotary_store_kv", "rotary_store")
for cls, lab in [(layers.ColumnParallelLinear, "col.forward"), (layers.RMSNorm, "rmsnorm")]:
    f = cls.forward

    def mk(f, lab):
        def g(self, *a, **k):
            s = time.perf_counter()
            r = f(self, *a, **k)
            acc[lab] += time.perf_counter() - s
            cnt[lab] += 1
            return r

        return g

    cls.forward = mk(f, lab)
for cls, meth, lab in [
    (layers.ColumnParallelLinear, "forward_silu_mul", "gateup"),
    (layers.RowParallelLinear, "forward", "rowlinear"),
    (llama.CausalLM, "forward", "CAUSAL_FWD"),
    (llama.CausalLM, "compute_logits", "logits"),
]:
    f = getattr(cls, meth)

    def mk(f, lab):
        def g(self, *a, **k):
            s = time.perf_counter()
            r = f(self, *a, **k)
            acc[lab] += time.perf_counter() - s
            cnt[lab] += 1
            return r

        return g

    setattr(cls, meth, mk(f, lab))
mode = sys.argv[1]
llm = LLM(bench_config("", "", "cpu", 1, spec_mode=mode))
ids = _prompt_ids(llm, 1)
p = SamplingParams(max_tokens=96, ignore_eos=True)
llm.generate(params=p, prompt_token_ids=ids)
acc.clear()
cnt.clear()
s = time.perf_counter()
llm.generate(params=p, prompt_token_ids=ids)
el = time.perf_counter() - s
steps = cnt["CAUSAL_FWD"]
print(mode, "wall", el, "target fwd calls", steps)
for k, v in sorted(acc.items(), key=lambda x: -x[1]):
    print(
        f"  {k:15s} {v / steps * 1e3:8.3f} ms/fwd  {cnt[k] / steps:6.1f} calls/fwd",
        f"{v / cnt[k] * 1e6:8.1f} us/call",
    )
