"""Two source trees' engines in one process, timed in alternation: is a host-side change faster?

A host whose speed drifts by tens of percent within seconds (the H200 machines do, `RESULTS.md`
sessions 25 and 31) hides a 5-10% change when each tree runs in its own process: one process meets a
slow spell, the other a fast one. Here both trees' `dspark` packages are imported into this process
(each under its own `sys.modules` set, swapped in before its engine runs, so lazy imports resolve
within the tree), each builds its engine, and the timed runs alternate A B B A ... with a short run
each, so any spell falls on both. The figure is the median over rounds of the paired ratio new / base
(and its spread), not a ratio of medians.

    python benchmarks/ab_trees.py --base /tmp/base/backend --device cuda --batch-sizes 8,64 \
        --modes off,static --rounds 16 --max-tokens 64

`--base`/`--new`: a tree's `backend/` folder (`git worktree add /tmp/base <commit>` or `git archive
<commit> backend | tar -x -C DIR`); `--new` defaults to this checkout's. Greedy outputs of the two
trees are compared too (`identical`: in fp32 they must match; in bf16 a kernel change may flip
near-ties).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))  # dspark_client's prompts, not a dspark tree
from prompts import PROMPTS  # noqa: E402


def _is_dspark(name: str) -> bool:
    return name == "dspark" or name.startswith("dspark.")


class Tree:
    """One tree's `dspark` modules, importable side by side with another tree's."""

    def __init__(self, name: str, backend: Path) -> None:
        self.name, self.backend = name, backend
        for module in [m for m in sys.modules if _is_dspark(m)]:
            del sys.modules[module]
        sys.path.insert(0, str(backend))
        try:
            self.dspark = importlib.import_module("dspark")
            importlib.import_module("dspark.training.data")
        finally:
            sys.path.remove(str(backend))
        assert Path(self.dspark.__file__).resolve().is_relative_to(backend.resolve()), self.dspark.__file__
        self.modules: dict[str, ModuleType] = {m: sys.modules[m] for m in sys.modules if _is_dspark(m)}

    def activate(self) -> None:
        """Make this tree's modules the ones `import dspark...` finds (submodules imported lazily land
        in its set: they resolve through its package's path)."""
        for module in [m for m in sys.modules if _is_dspark(m)]:
            del sys.modules[module]
        sys.modules.update(self.modules)

    def capture_new_modules(self) -> None:
        """Adopt submodules imported lazily while this tree was active."""
        self.modules.update({m: sys.modules[m] for m in sys.modules if _is_dspark(m)})


def build(tree: Tree, args: argparse.Namespace, mode: str, max_batch: int):  # noqa: ANN201 - tree's LLM
    """The tree's offline engine for `mode`, the benchmarks' configuration."""
    tree.activate()
    dspark = tree.dspark
    # "default": the serve default (EngineConfig's own mode, the adaptive gate on); other modes draft
    # on every step.
    speculation = {} if mode == "default" else {"spec_mode": mode, "adaptive_speculation": False}
    config = dspark.EngineConfig(
        model=args.model,
        draft_model=args.draft_model if mode != "off" else "",
        device=args.device,
        num_kv_pages=max(1024, 16 * max_batch),
        max_num_seqs=max(32, max_batch),
        **speculation,
    )
    llm = dspark.LLM(config)
    tree.capture_new_modules()
    engine_file = Path(sys.modules[type(llm.engine).__module__].__file__ or "").resolve()
    assert engine_file.is_relative_to(tree.backend.resolve()), (tree.name, engine_file)
    return llm


def timed_run(
    tree: Tree,
    llm,  # noqa: ANN001 - a tree's LLM
    ids: list[list[int]],
    max_tokens: int | list[int],
) -> tuple[float, list[list[int]]]:
    """Seconds and greedy tokens of one batch generate() (`max_tokens`: one for all, or one a request)."""
    tree.activate()
    if isinstance(max_tokens, int):
        params = tree.dspark.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    else:
        params = [tree.dspark.SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(params=params, prompt_token_ids=ids)
    seconds = time.perf_counter() - start
    tree.capture_new_modules()
    return seconds, [o.token_ids for o in outs]


def spread_lengths(batch: int, max_tokens: int, spread: float) -> list[int]:
    """Each request's max_tokens: `max_tokens` less up to `spread` of it, spread evenly over the batch in
    a fixed shuffled order (neighbouring prompts get unlike lengths)."""
    span = round(spread * max_tokens)
    return [max_tokens - (span * ((i * 37) % batch)) // max(batch - 1, 1) for i in range(batch)]


def _gate_rates(llm, batch: int) -> dict[int, int]:  # noqa: ANN001 - a tree's LLM
    """The adaptive gate's estimated tokens/s per draft length for `batch` requests (empty: no gate)."""
    gate = llm.engine.gate
    return {} if gate is None else {n: round(rate) for n, rate in gate.rates(batch).items()}


def _gate_timed(llm, batch: int) -> dict[int, dict]:  # noqa: ANN001 - a tree's LLM
    """Per draft length, in `batch`'s tier: how many of its steps the gate timed, and the latest times
    its estimate reads (ms; a gate keeping a moving average instead: its value), to tell a length's
    estimate made of warm-up steps from one kept fresh by its runs (empty: no gate, or no such tier)."""
    gate = llm.engine.gate
    # The tier by the tree's own rule (its gate module's `next_pow2`, as `SpeculationGate.rates` reads it).
    stats = None if gate is None else gate._tiers.get(sys.modules[type(gate).__module__].next_pow2(batch))
    timed = {}
    for length, seconds in sorted(({} if stats is None else stats.seconds).items()):
        values = getattr(seconds, "recent", None)
        values = [getattr(seconds, "value", 0.0)] if values is None else list(values)
        # A tree whose gate marks warm-up times provisional keeps (time, provisional) pairs: "w" marks one.
        timed[length] = {
            "count": getattr(seconds, "count", 0),
            "ms": [
                f"{1e3 * v[0]:.3f}w"
                if isinstance(v, tuple) and v[1]
                else round(1e3 * (v[0] if isinstance(v, tuple) else v), 3)
                for v in values
            ],
            "value_ms": round(1e3 * getattr(seconds, "value", 0.0), 3),
        }
    return timed


def _attention_tiles(tree: Tree) -> dict[str, str]:
    """The paged-attention tiles the tree's autotuner chose, per kind (group, head_dim, window class,
    split): two trees of the same code whose plain greedy bf16 outputs differ have likely chosen other
    tiles (each tree's kernels are its own objects, tuned apart, by timing)."""
    attention = tree.modules.get("dspark.kernels.attention")
    kernel = getattr(attention, "_paged_attention_kernel", None)
    cache = getattr(kernel, "cache", None) or {}
    return {str(tuple(key[:4])): str(config) for key, config in cache.items()}


def _gate_chosen(llm) -> dict[int, int]:  # noqa: ANN001 - a tree's LLM
    """How many steps the adaptive gate ran at each draft length, over every tier (empty: no gate)."""
    gate = llm.engine.gate
    chosen: dict[int, int] = {}
    for stats in [] if gate is None else gate._tiers.values():
        for length, count in stats.chosen.items():
            chosen[length] = chosen.get(length, 0) + count
    return dict(sorted(chosen.items()))


def main(argv: list[str] | None = None) -> None:
    """Run the rounds, print a JSON line per (batch, mode) and a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the older tree's backend/")
    parser.add_argument("--new", type=Path, default=ROOT / "backend")
    parser.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct"))
    parser.add_argument("--draft-model", default=str(ROOT / "drafters/SmolLM2-135M-Instruct-dspark"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="8,64")
    parser.add_argument("--modes", default="off,static", help="of off, static, compact, default")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.0,
        help="requests' max_tokens spread evenly over the top this share of --max-tokens (0.5 with 128: "
        "64-128), so that they end at different steps, as a server's do",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    trees = [Tree("base", args.base), Tree("new", args.new)]
    engines = {(t.name, m): build(t, args, m, max(batch_sizes)) for t in trees for m in modes}
    rows = []
    for batch in batch_sizes:
        trees[0].activate()
        from dspark.training.data import encode_prompt

        tokenizer = engines[("base", modes[0])].tokenizer
        ids = [encode_prompt(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
        lengths = spread_lengths(batch, args.max_tokens, args.max_tokens_spread)
        for mode in modes:
            for tree in trees:  # warm-up: kernels, graph captures of this batch's sizes
                timed_run(tree, engines[(tree.name, mode)], ids, min(32, args.max_tokens))
            seconds: dict[str, list[float]] = {"base": [], "new": []}
            tokens: dict[str, list[list[int]]] = {}
            # The gate's choices in each timed run (its warm-ups and probes land in some runs only).
            chosen_by_run: dict[str, list[dict[int, int]]] = {"base": [], "new": []}
            for r in range(args.rounds):
                order = trees if r % 2 == 0 else trees[::-1]
                for tree in order:
                    engine = engines[(tree.name, mode)]
                    before = _gate_chosen(engine)
                    took, out = timed_run(tree, engine, ids, lengths)
                    seconds[tree.name].append(took)
                    tokens.setdefault(tree.name, out)
                    after = _gate_chosen(engine)
                    chosen_by_run[tree.name].append({n: after[n] - before.get(n, 0) for n in after})
            ratios = sorted(b / n for b, n in zip(seconds["base"], seconds["new"], strict=True))
            produced = sum(len(t) for t in tokens["new"])
            same = sum(a == b for a, b in zip(tokens["base"], tokens["new"], strict=True)) / batch
            row = {
                "batch": batch,
                "mode": mode,
                "base_tok_s": produced / statistics.median(seconds["base"]),
                "new_tok_s": produced / statistics.median(seconds["new"]),
                "ratio_median": statistics.median(ratios),
                "ratio_q1": ratios[len(ratios) // 4],
                "ratio_q3": ratios[(3 * len(ratios)) // 4],
                "rounds": args.rounds,
                "identical": same,
            }
            if mode == "default":  # what each tree's gate believes, per draft length, at this batch
                row["gate_rates"] = {t.name: _gate_rates(engines[(t.name, mode)], batch) for t in trees}
                row["gate_chosen"] = {t.name: _gate_chosen(engines[(t.name, mode)]) for t in trees}
                row["gate_chosen_by_run"] = chosen_by_run
                row["seconds_by_run"] = seconds
                row["gate_timed"] = {t.name: _gate_timed(engines[(t.name, mode)], batch) for t in trees}
            row["attention_tiles"] = {t.name: _attention_tiles(t) for t in trees}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| batch | mode | base tok/s | new tok/s | new / base (paired, median) | quartiles | identical |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['mode']} | {r['base_tok_s']:.0f} | {r['new_tok_s']:.0f} | "
            f"**{r['ratio_median']:.3f}** | {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} | {r['identical']:.0%} |"
        )
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


if __name__ == "__main__":
    main()
