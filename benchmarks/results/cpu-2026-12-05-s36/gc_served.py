"""The engine process's garbage collection against the offline engine's, on the same closed-loop work
(issue 18: served steps ~1.5x offline in every host phase on the H200; a collector pass lands in
whichever phase allocates when it starts).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/gc_served.py 64 4
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/results/cpu-2026-12-05-s36/gc_served.py 32 2 smollm2

The tests' tiny target (or SmolLM2: `smollm2`) on the CPU (eager), plain decoding, `streams`
closed-loop streams of `rounds` requests of 64 greedy tokens each: offline (`LLM.generate` of
`streams` prompts, `rounds` times) and through `EngineProcess` (a stream submits its next request
when its last one ended), with the engine loop's totals per step: wall, host phases, hand-over, the
collector's ms and full passes.
"""

import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from agreement import loop_shares  # noqa: E402
from tiny_models import write_tiny_target  # noqa: E402

from dspark import LLM, EngineConfig, SamplingParams  # noqa: E402
from dspark.process_heap import freeze_startup_heap  # noqa: E402
from dspark.serving.engine_process import EngineProcess  # noqa: E402

KEYS = (
    "step_ms",
    "decode_step_ms",
    "prefill",
    "handover_ms",
    "gc_ms",
    "gc_full",
    "host_schedule_ms",
    "host_target_ms",
    "host_emit_ms",
)


def prompt(i: int) -> list[int]:
    return [(7 * i + j) % 500 + 1 for j in range(24)]


def main() -> None:
    streams, rounds = int(sys.argv[1]), int(sys.argv[2])
    smollm2 = len(sys.argv) > 3 and sys.argv[3] == "smollm2"  # the real target: its heap, torch's
    work = Path(tempfile.mkdtemp(prefix="gc-served-"))
    target = "" if smollm2 else write_tiny_target(work / "target", vocab_size=512, hidden=64)
    config = EngineConfig(
        model=str(target) if target else "",
        spec_mode="off",
        device="cpu",
        num_kv_pages=4096,
        kv_page_size=16,
        max_num_seqs=streams,
        max_num_batched_tokens=4096,
    )
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm = LLM(config)
    llm.generate(params=params, prompt_token_ids=[prompt(i) for i in range(streams)])
    freeze_startup_heap()
    before, started = llm.engine.load().loop, time.perf_counter()
    tokens = 0
    for r in range(rounds):
        outs = llm.generate(params=params, prompt_token_ids=[prompt(r * streams + i) for i in range(streams)])
        tokens += sum(len(o.token_ids) for o in outs)
    seconds = time.perf_counter() - started
    offline = loop_shares(before, llm.engine.load().loop, seconds, tokens)
    llm.engine.close()

    engine = EngineProcess(config)
    engine.start()
    try:

        def closed_loop(first: int, count: int, done: threading.Event) -> None:
            left = [count]

            def submit(n: int) -> None:
                def on_delta(delta) -> None:  # noqa: ANN001
                    if delta.finished:
                        left[0] -= 1
                        if left[0] > 0:
                            submit(n + 1)
                        else:
                            done.set()

                engine.submit(f"s{first}-{n}", params, on_delta, prompt_token_ids=prompt(first * 1000 + n))

            submit(0)

        warm = [threading.Event() for _ in range(streams)]
        for s in range(streams):
            closed_loop(s, 1, warm[s])
        for event in warm:
            event.wait(120)
        time.sleep(0.2)
        before, started = engine.load().loop, time.perf_counter()
        done = [threading.Event() for _ in range(streams)]
        for s in range(streams):
            closed_loop(100 + s, rounds, done[s])
        for event in done:
            event.wait(600)
        seconds = time.perf_counter() - started
        time.sleep(0.1)
        served = loop_shares(before, engine.load().loop, seconds, streams * rounds * 64)
    finally:
        engine.shutdown()
    print(f"{'':18s}" + "".join(f"{k:>17s}" for k in ("tok/s",) + KEYS))
    for name, loop in (("offline", offline), ("engine process", served)):
        print(
            f"{name:18s}"
            + f"{loop['tokens_per_step'] * loop['steps_per_s']:17.0f}"
            + "".join(f"{loop.get(k, 0):17.3f}" for k in KEYS)
        )


if __name__ == "__main__":
    main()
