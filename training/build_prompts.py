"""Build the drafter's prompt sets from text and code that Debian and PyPI packages ship.

    apt-get update
    apt-get install -y python3.11-doc wamerican wordnet-base fortunes fortunes-min golang-1.19-src \
        rust-src ruby3.1 perl-doc perl-modules-5.36 manpages-dev git-doc debian-faq debian-reference-en
    python3 -m venv /tmp/prompts-venv
    /tmp/prompts-venv/bin/pip install mathematics-dataset==1.0.1 sympy==1.5.1 numpy==1.23.5
    /tmp/prompts-venv/bin/python training/build_prompts.py   # prompts_{train,eval}.jsonl + manifest

(The venv's interpreter must be CPython 3.11: its standard library is a source too; mathematics-dataset
needs the old sympy and numpy pinned above.)

Four domains, each prompt recording its `source`, its `key` (the unit held out) and its `kind`:
- chat: FAQ entries of Debian, Git and Python (the question alone, or a conversation in `messages`: the
  question, the FAQ's real answer, a follow-up), WordNet words (questions, and conversations whose answer
  is the WordNet gloss), everyday questions about common WordNet concepts (how a thing works, why
  something happens, tips, facts, recipes, comparisons; some as conversations), fortune quotes
  (discussed, or an earlier assistant turn), Debian Reference topics;
- code: one prompt per documented function of the Go, Rust, Ruby, Perl and Python standard libraries and
  per C man page (write it from its documentation, complete it, explain it, fix a planted bug, translate
  it, review or test it), perlfaq and Python FAQ conversations, Python documentation examples;
- prose: paragraphs of the Python documentation, the Debian Reference and the Git user manual, fortunes
  and WordNet example sentences, as instructions of many kinds (summarize in N words, rewrite formally,
  list key points, ...) or continuations; writing tasks from dictionary words;
- math: mathematics_dataset questions (arithmetic, algebra, calculus, comparison, measurement, numbers,
  polynomials, probability), asked in many ways or after an earlier answered one, and word problems.

The evaluation set is held out by source: a whole document, FAQ entry, file, module, word or generator
module falls on one side only (by a hash of its key), and no prompt (whole conversation) occurs on both
sides. It has `--eval-per-domain` prompts per domain; the training set is `--train-size` prompts, shared
between the domains and, within one, between its sources (or languages) so that no source dominates.
Output is deterministic for a given machine and seed.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

from prompt_code import library_prompts
from prompt_common import EVAL_PERCENT, Prompt, held_out
from prompt_math import MATH_EVAL_PERCENT, generated_prompts, word_problem_prompts
from prompt_text import (
    concept_prompts,
    debian_doc_prompts,
    fortune_prompts,
    git_doc_prompts,
    perlfaq_prompts,
    python_doc_prompts,
    word_prompts,
    wordnet_prompts,
)

HERE = Path(__file__).resolve().parent
DOMAIN_SHARES = {"chat": 0.30, "code": 0.30, "prose": 0.20, "math": 0.20}
# Within a domain, sources (for code: languages) share by these weights (1 when not listed); a source
# with fewer prompts than its share gives the rest to the others.
GROUP_WEIGHTS = {
    "code": {"python": 0.25, "go": 0.16, "rust": 0.12, "ruby": 0.15, "perl": 0.15, "c": 0.17},
    "math": {"mathematics-dataset": 3.0},
    # Everyday questions about common things: what users ask most, so the largest chat group.
    "chat": {"wordnet-base/concepts": 2.0},
    "prose": {"wordnet-base/concepts": 0.5},
}
DEBIAN_PACKAGES = {
    "python3.11-doc": "PSF-2.0",
    "wamerican": "SCOWL (permissive, see /usr/share/doc/wamerican/copyright)",
    "wordnet-base": "WordNet-3.0 (permissive, BSD-like)",
    "fortunes": "BSD-4-Clause-UC (fortune-mod; cookie files collected from public postings)",
    "fortunes-min": "BSD-4-Clause-UC",
    "golang-1.19-src": "BSD-3-Clause (Go)",
    "rust-src": "MIT OR Apache-2.0",
    "ruby3.1": "Ruby OR BSD-2-Clause",
    "perl-doc": "GPL-1+ OR Artistic",
    "perl-modules-5.36": "GPL-1+ OR Artistic",
    "manpages-dev": "Linux man-pages licences (verbatim / GPL, per page)",
    "git-doc": "GPL-2",
    "debian-faq": "verbatim and modified copies under the same notice (SPI)",
    "debian-reference-en": "GPL-2+",
}
PIP_PACKAGES = {"mathematics-dataset": "Apache-2.0", "sympy": "BSD-3-Clause", "numpy": "BSD-3-Clause"}


def eval_percent(key: str) -> int:
    """Share of units held out: more for the few dozen generator modules and word-problem scenarios."""
    return MATH_EVAL_PERCENT if key.startswith(("mathematics-dataset:", "word-problem:")) else EVAL_PERCENT


def group(prompt: Prompt) -> str:
    """What a domain's budget is shared between: the language of a code prompt, else the source package."""
    if prompt.domain == "code":
        return prompt.kind.split("/")[1]
    return prompt.source.split(":")[0]


def allocate(total: int, available: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """Split `total` between groups in proportion to their weights, none given more than it has; what a
    group cannot take goes to the others."""
    share = dict.fromkeys(available, 0)
    open_groups = {g for g, n in available.items() if n > 0}
    left = total
    while left > 0 and open_groups:
        weight = sum(weights.get(g, 1.0) for g in open_groups)
        given = 0
        for g in sorted(open_groups):
            want = max(1, round(left * weights.get(g, 1.0) / weight))
            take = min(want, available[g] - share[g], left - given)
            share[g] += take
            given += take
        open_groups = {g for g in open_groups if share[g] < available[g]}
        left -= given
        if given == 0:
            break
    return share


def sample_side(
    pools: dict[str, dict[str, list[Prompt]]], per_domain: dict[str, int], rng: random.Random
) -> list[Prompt]:
    """`per_domain[d]` prompts of each domain, shared between its groups by `allocate`."""
    chosen: list[Prompt] = []
    for domain in sorted(pools):
        by_group = pools[domain]
        available = {g: len(p) for g, p in by_group.items()}
        for g, n in sorted(allocate(per_domain[domain], available, GROUP_WEIGHTS.get(domain, {})).items()):
            chosen += rng.sample(by_group[g], n)
    rng.shuffle(chosen)
    return chosen


def collect(rng: random.Random) -> list[Prompt]:
    """Every prompt the sources give, a repeated id (two methods of one name in a file) numbered."""
    prompts = [
        *python_doc_prompts(rng),
        *debian_doc_prompts(rng),
        *perlfaq_prompts(rng),
        *git_doc_prompts(rng),
        *wordnet_prompts(rng),
        *concept_prompts(rng),
        *fortune_prompts(rng),
        *word_prompts(rng),
        *library_prompts(rng),
        *generated_prompts(rng),
        *word_problem_prompts(rng),
    ]
    seen: Counter[str] = Counter()
    for prompt in prompts:
        seen[prompt.id] += 1
        if seen[prompt.id] > 1:
            prompt.id += f"~{seen[prompt.id]}"
    return prompts


def split(prompts: list[Prompt]) -> dict[str, dict[str, dict[str, list[Prompt]]]]:
    """side -> domain -> group -> prompts: held out by key; a conversation on both sides, or twice on one,
    kept once (on the evaluation side)."""
    sides: dict[str, dict[str, dict[str, list[Prompt]]]] = {"train": {}, "eval": {}}
    seen: dict[str, set[str]] = {"train": set(), "eval": set()}
    ordered = sorted(prompts, key=lambda p: not held_out(p.key, eval_percent(p.key)))  # eval side first
    for prompt in ordered:
        side = "eval" if held_out(prompt.key, eval_percent(prompt.key)) else "train"
        text = prompt.text()
        if text in seen["eval"] or text in seen[side]:
            continue
        seen[side].add(text)
        sides[side].setdefault(prompt.domain, {}).setdefault(group(prompt), []).append(prompt)
    return sides


def package_versions(names: list[str]) -> dict[str, str]:
    """Debian versions of the packages the sources come from."""
    out = subprocess.run(["dpkg-query", "-W", *names], capture_output=True, text=True).stdout
    return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)


def pip_versions(names: list[str]) -> dict[str, str]:
    """Installed versions of PyPI packages (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def manifest(seed: int, pools: dict, written: dict[str, list[Prompt]]) -> dict:
    """Provenance: package versions and licences, held-out rule, counts per side, domain and source."""
    debian = package_versions(list(DEBIAN_PACKAGES))
    pip = pip_versions(list(PIP_PACKAGES))
    counts: dict = {}
    for side, chosen in written.items():
        by = Counter((p.domain, group(p)) for p in chosen)
        counts[side] = {
            domain: {
                "written": sum(n for (d, _), n in by.items() if d == domain),
                "by_source": {
                    g: {"available": len(pool), "written": by[(domain, g)]}
                    for g, pool in sorted(pools[side][domain].items())
                },
            }
            for domain in sorted(pools[side])
        }
        counts[side]["multi_turn"] = sum(p.messages is not None for p in chosen)
    kinds = Counter(p.kind for p in written["train"])
    return {
        "seed": seed,
        "eval_percent_by_key": EVAL_PERCENT,
        "eval_percent_by_key_math": MATH_EVAL_PERCENT,
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "debian_packages": {
            n: {"version": debian.get(n), "licence": lic} for n, lic in DEBIAN_PACKAGES.items()
        },
        "pip_packages": {n: {"version": pip.get(n), "licence": lic} for n, lic in PIP_PACKAGES.items()},
        "counts": counts,
        "train_kinds": dict(sorted(kinds.items())),
    }


def main() -> int:
    """Build and write the prompt sets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--train-size", type=int, default=28000)
    parser.add_argument("--eval-per-domain", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import mathematics_dataset  # noqa: F401
    except ImportError:
        sys.exit("missing mathematics_dataset: see this script's docstring for the pip install")
    rng = random.Random(args.seed)
    pools = split(collect(rng))
    train_sizes = {d: round(args.train_size * share) for d, share in DOMAIN_SHARES.items()}
    written = {
        "train": sample_side(pools["train"], train_sizes, random.Random(f"{args.seed}/train")),
        "eval": sample_side(
            pools["eval"],
            dict.fromkeys(DOMAIN_SHARES, args.eval_per_domain),
            random.Random(f"{args.seed}/eval"),
        ),
    }
    for side, chosen in written.items():
        path = args.out_dir / f"prompts_{side}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for prompt in chosen:
                f.write(json.dumps(prompt.record(), ensure_ascii=False) + "\n")
        print(f"wrote {len(chosen)} prompts ({path.stat().st_size / 2**20:.2f} MiB) to {path}")
    (args.out_dir / "prompts_manifest.json").write_text(
        json.dumps(manifest(args.seed, pools, written), indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
