"""Session 61: one engine injecting every step's features, one deferring them (`defer_inject`), one
process, alternating rounds; `swap` builds the other first (the first engine built ran ~3.5% slower
whichever it was).

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s61/deferred_inject_side_by_side.py 8 default 6 [swap]
"""
import sys, time, statistics
sys.path.insert(0, "/work/main/benchmarks")
import e2e, argparse
from e2e import _prompt_ids, bench_config
from dspark import LLM, SamplingParams
p = argparse.ArgumentParser(); e2e.add_engine_arguments(p, max_tokens=64); args = p.parse_args(["--device","cpu","--batch","1"])
B = int(sys.argv[1]); mode = sys.argv[2]
engines = {}
for name in (["each-step", "defer"] if "swap" in sys.argv else ["defer", "each-step"]):
    fields = {} if mode == "default" else {"spec_mode": mode, "adaptive_speculation": False}
    llm = LLM(bench_config(args.model, args.draft_model, "cpu", B, **fields))
    llm.engine.proposer.defer_inject = name == "defer"
    engines[name] = llm
ids = _prompt_ids(engines["defer"], B)
params = SamplingParams(max_tokens=64, ignore_eos=True)
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=ids)
times = {m: [] for m in engines}; outs = {}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for m in order:
        t = time.perf_counter(); o = engines[m].generate(params=params, prompt_token_ids=ids); times[m].append(time.perf_counter() - t)
        outs[m] = [x.token_ids for x in o]
for m, ts in times.items():
    print(mode, B, m, "tok/s %.1f" % (B * 64 / statistics.median(ts)), [round(t, 2) for t in ts])
print("identical", outs["defer"] == outs["each-step"])
