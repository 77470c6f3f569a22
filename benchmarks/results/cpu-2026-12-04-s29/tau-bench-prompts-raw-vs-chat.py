"""tau on `dspark-client bench`'s 8 prompts, raw text vs the chat template (static, blocks of 3, CPU)."""

from dspark import LLM, EngineConfig, SamplingParams
from dspark_client.bench import PROMPTS  # dspark-client bench's prompts

llm = LLM(EngineConfig(adaptive_speculation=False, max_num_seqs=8))
tok = llm.tokenizer
params = SamplingParams(max_tokens=48, ignore_eos=True)
for name, ids in [
    ("raw", [tok.encode(p) for p in PROMPTS]),
    (
        "chat",
        [
            tok.encode(
                tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                add_special_tokens=False,
            )
            for p in PROMPTS
        ],
    ),
]:
    outs = llm.generate(params=params, prompt_token_ids=ids)
    taus = []
    for o in outs:
        s = o.spec_stats
        taus.append((s.accepted_tokens + s.steps) / s.steps)
    print(name, "tau", round(sum(taus) / len(taus), 3), [round(t, 2) for t in taus])
    print("  sample:", repr(outs[0].text[:150]))
