import sys, time, argparse
sys.path.insert(0, "/work/main/benchmarks")
from e2e import _prompt_ids, bench_config, add_engine_arguments
from dspark import LLM, SamplingParams
p = argparse.ArgumentParser(); add_engine_arguments(p, max_tokens=96); p.add_argument("--modes", default="off,static"); p.add_argument("--keep", action="store_true")
a = p.parse_args(sys.argv[1:])
llms = {}
for mode in a.modes.split(","):
    spec = {"spec_mode": mode, "adaptive_speculation": False}
    llms[mode] = LLM(bench_config(a.model, a.draft_model, "cpu", 1, **spec))
    if not a.keep:
        pass
for rnd in range(2):
    for mode, llm in llms.items():
        ids = _prompt_ids(llm, 8)
        params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
        llm.generate(params=SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=ids[:1])
        timer = llm.engine.timer; timer.reset(); timer.enabled, timer.synchronize = True, False
        t0 = time.perf_counter(); n = 0
        for i in ids:
            out = llm.generate(params=params, prompt_token_ids=[i]); n += len(out[0].token_ids)
        el = time.perf_counter() - t0
        timer.enabled = False
        s = {k: round(v, 2) for k, v in timer.summary().items()}
        print(rnd, mode, f"{n/el:.1f} tok/s", s, flush=True)
