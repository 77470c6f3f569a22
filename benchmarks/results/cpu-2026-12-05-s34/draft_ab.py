import sys, time, statistics
sys.path.insert(0, "/work/main/benchmarks")
from e2e import _prompt_ids, bench_config
from dspark import LLM, SamplingParams
from dspark.spec import proposer as P
orig = P.DSparkProposer._block_heads
def all_at_once(self, block_ids, positions, batch):
    on = self._on_gpu; self._on_gpu = True
    try:
        return orig(self, block_ids, positions, batch)
    finally:
        self._on_gpu = on
batch = int(sys.argv[1])
cfg = bench_config("", "", "cpu", batch, spec_mode="static", adaptive_speculation=False)
llm = LLM(cfg)
ids = _prompt_ids(llm, batch)
params = SamplingParams(max_tokens=48, ignore_eos=True)
llm.generate(params=params, prompt_token_ids=ids)
res = {"per_position": [], "all": []}; toks = {}
for r in range(3):
    for name in res:
        P.DSparkProposer._block_heads = all_at_once if name == "all" else orig
        timer = llm.engine.timer; timer.reset(); timer.enabled = True
        t = time.perf_counter(); out = llm.generate(params=params, prompt_token_ids=ids); el = time.perf_counter() - t
        timer.enabled = False
        res[name].append((el, timer.summary()["draft"]))
        toks.setdefault(name, [o.token_ids for o in out])
for name, v in res.items():
    print(name, "s", [round(a, 3) for a, _ in v], "draft ms/step", [round(b, 2) for _, b in v])
print("identical", toks["all"] == toks["per_position"])
