"""Session 61: plain decoding, the serve default's engine held at plain steps (gated-plain) and the serve
default, built in that order in one process, 4 alternating rounds of 8 requests x 64 tokens (CPU).

    .venv/bin/python benchmarks/results/cpu-2026-12-07-s61/plain_steps_side_by_side.py 8
"""
import sys, time, statistics
sys.path.insert(0, "/work/main/benchmarks")
import e2e, argparse
from e2e import _prompt_ids, bench_config
from dspark import LLM, SamplingParams
p = argparse.ArgumentParser(); e2e.add_engine_arguments(p, max_tokens=64); args = p.parse_args(["--device","cpu","--batch","8"])
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
engines = {}
for mode in ["off", "gated-plain", "default"]:
    gp = mode == "gated-plain"
    fields = {} if mode == "default" else {"spec_mode": "static" if gp else "off", "adaptive_speculation": gp}
    cfg = bench_config(args.model, args.draft_model if mode != "off" else "", "cpu", B, **fields)
    llm = LLM(cfg)
    if gp:
        llm.engine.gate.draft_length = lambda num_requests, draining=None: 0
    engines[mode] = llm
ids = _prompt_ids(engines["off"], B)
params = SamplingParams(max_tokens=64, ignore_eos=True)
for llm in engines.values():
    llm.generate(params=SamplingParams(max_tokens=16, ignore_eos=True), prompt_token_ids=ids)
times = {m: [] for m in engines}
for r in range(4):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for m in order:
        t = time.perf_counter(); engines[m].generate(params=params, prompt_token_ids=ids); times[m].append(time.perf_counter() - t)
for m, ts in times.items():
    print(m, "median s %.3f" % statistics.median(ts), "tok/s %.1f" % (B * 64 / statistics.median(ts)), [round(t, 2) for t in ts])
g = engines["default"].engine.gate
print("default gate chosen", {t: dict(s.chosen) for t, s in g._tiers.items()})
