"""Build the drafter's prompt sets from text that packages on this machine ship.

    python3 training/build_prompts.py            # writes training/prompts_{train,eval}.jsonl + manifest

The training file starts with `--train-per-domain` prompts sampled per domain and goes on with every other
available training prompt (`--sampled-only` leaves those out).

Sources (each prompt records its own in `source`):
- the Python documentation's reST sources, Debian package python3.11-doc
  (/usr/share/doc/python3.11/html/_sources): FAQ questions, glossary terms, prose paragraphs and code
  examples;
- the docstrings and source of the Python standard library of the interpreter running this script;
- the word list of Debian package wamerican (/usr/share/dict/words), through question and writing
  templates.

Prompts are split by domain (chat, code, prose). The evaluation set is held out by source: a whole
document, module or word goes to one side only (by a hash of its name), so no training prompt shares a
paragraph, a function or a word with an evaluation prompt. Output is deterministic for a given machine.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
WORDS = Path("/usr/share/dict/words")
HERE = Path(__file__).resolve().parent
EVAL_PERCENT = 8
# FAQ files whose questions are general conversation rather than programming.
CHAT_FAQS = ("faq/general.rst.txt", "faq/installed.rst.txt", "faq/windows.rst.txt")
# Standard-library areas that are tests, vendored tools or platform glue, not library code.
SKIP_MODULES = ("test", "idlelib", "lib2to3", "ensurepip", "turtledemo", "tkinter", "site-packages", "__")

CHAT_WORD_TEMPLATES = (
    "What does the word '{w}' mean?",
    "Give me three example sentences that use the word '{w}'.",
    "Where does the word '{w}' come from?",
    "What are some synonyms and antonyms of '{w}'?",
    "How would you explain the word '{w}' to a ten-year-old?",
    "Is '{w}' a formal or an informal word? When would I use it?",
    "Can you help me remember how to spell '{w}'?",
    "My friend used the word '{w}' in a message. What did they mean?",
)
CODE_FUNCTION_TEMPLATES = (
    "Write a Python function `{name}{signature}` that does the following: {summary}",
    "Implement `{name}{signature}` in Python. {summary} Add a short usage example.",
    "How would I write a function called `{name}` in Python? It should do this: {summary}",
)
CODE_SOURCE_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Review this Python code and suggest one improvement:\n\n```python\n{code}\n```",
    "Write a docstring for this Python function:\n\n```python\n{code}\n```",
)
CODE_EXAMPLE_TEMPLATES = (
    "What does this Python code do?\n\n```python\n{code}\n```",
    "Explain this Python snippet step by step:\n\n```python\n{code}\n```",
)
CODE_TERM_TEMPLATES = (
    "In Python, what is meant by '{term}'? Give a small example.",
    "Explain the Python concept '{term}' with a code example.",
)
PROSE_PARAGRAPH_TEMPLATES = (
    "Summarize the following paragraph in two sentences:\n\n{text}",
    "Rewrite the following text in plain language for a beginner:\n\n{text}",
    "Turn the following notes into a short, friendly paragraph for a newsletter:\n\n{text}",
)
PROSE_WORD_TEMPLATES = (
    "Write a short story about {a} and {b}.",
    "Write a four-line poem about {a}.",
    "Write a paragraph describing {a} to someone who has never heard of it.",
    "Write a short letter to a friend that mentions {a} and {b}.",
    "Write the opening paragraph of a novel in which {a} plays an important role.",
)


@dataclass
class Prompt:
    """One prompt with its provenance."""

    id: str
    domain: str
    prompt: str
    source: str


def held_out(key: str) -> bool:
    """Whether everything derived from `key` (a document, module or word) belongs to the evaluation set."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100 < EVAL_PERCENT


def clean_rst(text: str) -> str:
    """Plain text of a reST fragment: roles, literals, links and emphasis reduced to their words."""
    text = re.sub(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", text)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*|\*([^*]+)\*", lambda m: m.group(1) or m.group(2), text)
    text = re.sub(r"`([^`]+)`_*", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def rst_blocks(path: Path) -> Iterator[tuple[str, str]]:
    """(kind, text) blocks of a reST file: "heading", "paragraph" or "code" (a literal block after ::)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    i = 0
    literal_next = False
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        if i + 1 < len(lines) and re.fullmatch(r"([=\-~^*#\"'])\1{2,}", lines[i + 1].strip() or "x"):
            yield "heading", line.strip()
            i += 2
            continue
        if line.startswith((" ", "\t")):
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            if literal_next:
                yield "code", textwrap.dedent("\n".join(block)).strip("\n")
            literal_next = False
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith((" ", "\t")):
            para.append(lines[i])
            i += 1
        text = " ".join(p.strip() for p in para)
        literal_next = text.endswith("::")
        if not text.startswith(("..", ":", "|", "+", "=", "-", "*", "#")):
            yield "paragraph", text


def doc_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Prompts from the Python documentation sources."""
    for path in sorted(DOCS.rglob("*.rst.txt")):
        rel = path.relative_to(DOCS).as_posix()
        source = f"python3.11-doc:{DOCS / rel}"
        blocks = list(rst_blocks(path))
        for n, (kind, text) in enumerate(blocks):
            pid = f"{rel}#{n}"
            if kind == "heading" and rel.startswith("faq/") and text.endswith("?"):
                yield Prompt(pid, "chat" if rel in CHAT_FAQS else "code", clean_rst(text), source)
            elif kind == "paragraph" and not rel.startswith(("faq/", "c-api/", "whatsnew/changelog")):
                plain = clean_rst(text).removesuffix(":")
                if 250 <= len(plain) <= 1000 and plain.count(" ") > 30:
                    template = rng.choice(PROSE_PARAGRAPH_TEMPLATES)
                    yield Prompt(pid, "prose", template.format(text=plain), source)
            elif kind == "code" and not rel.startswith("c-api/"):
                code = text.replace("\t", "    ")
                foreign = code.lstrip().startswith(("$", "C:")) or any(
                    m in code for m in ("/*", "#include", "doctest:")
                )
                if 3 <= code.count("\n") + 1 <= 20 and 60 <= len(code) <= 800 and not foreign:
                    template = rng.choice(CODE_EXAMPLE_TEMPLATES)
                    yield Prompt(pid, "code", template.format(code=code), source)
        if rel == "glossary.rst.txt":
            yield from glossary_prompts(path, source, rng)


def glossary_prompts(path: Path, source: str, rng: random.Random) -> Iterator[Prompt]:
    """One question per term of the Python glossary."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if (
            line.startswith("   ")
            and not line.startswith("    ")
            and line.strip()
            and not line.strip().startswith("..")
        ):
            term = clean_rst(line)
            if 2 <= len(term) <= 40 and not term.endswith("."):
                yield Prompt(
                    f"glossary:{term}", "code", rng.choice(CODE_TERM_TEMPLATES).format(term=term), source
                )


def stdlib_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Prompts from the standard library: write-this-function from docstrings, explain-this-source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    version = f"cpython-{sys.version.split()[0]}-stdlib"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part.startswith(SKIP_MODULES) for part in rel.split("/")[:-1]) or rel.startswith(SKIP_MODULES):
            continue
        try:
            source_text = path.read_text(encoding="utf-8")
            tree = ast.parse(source_text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            summary = re.sub(r"\s+", " ", doc.split("\n\n")[0]).strip()
            pid = f"{rel}:{node.name}:{node.lineno}"
            where = f"{version}:{rel}:{node.name}"
            if 40 <= len(summary) <= 300:
                signature = "(" + ast.unparse(node.args) + ")"
                template = rng.choice(CODE_FUNCTION_TEMPLATES)
                yield Prompt(
                    pid + ":write",
                    "code",
                    template.format(name=node.name, signature=signature, summary=summary),
                    where,
                )
            code = ast.get_source_segment(source_text, node) or ""
            if 4 <= code.count("\n") + 1 <= 25 and len(code) <= 900:
                template = rng.choice(CODE_SOURCE_TEMPLATES)
                yield Prompt(pid + ":read", "code", template.format(code=textwrap.dedent(code)), where)


def word_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Chat questions and writing tasks about dictionary words (a pair of words is drawn from one side)."""
    words = sorted({w for w in WORDS.read_text(encoding="utf-8").split() if re.fullmatch(r"[a-z]{4,12}", w)})
    sides = {True: [w for w in words if held_out(w)], False: [w for w in words if not held_out(w)]}
    source = f"wamerican:{WORDS}"
    for word in rng.sample(words, 6000):
        yield Prompt(f"word:{word}:chat", "chat", rng.choice(CHAT_WORD_TEMPLATES).format(w=word), source)
    for a in rng.sample(words, 3000):
        b = rng.choice(sides[held_out(a)])
        template = rng.choice(PROSE_WORD_TEMPLATES)
        yield Prompt(f"word:{a}:{b}:prose", "prose", template.format(a=a, b=b), source)


def split_key(prompt: Prompt) -> str:
    """What a prompt is held out by: its document, its module, or its word(s)."""
    if prompt.id.startswith("word:"):
        return prompt.id.split(":")[1]
    if prompt.id.startswith("glossary:"):
        return prompt.id
    return prompt.id.split("#")[0].split(":")[0]


def package_versions() -> dict[str, str]:
    """Debian versions of the packages the sources come from."""
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "python3.11-doc", "wamerican"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)


def main() -> int:
    """Build and write the prompt sets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--train-per-domain", type=int, default=2000)
    parser.add_argument("--eval-per-domain", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sampled-only",
        action="store_true",
        help="write only the sampled training prompts, not every other available one after them",
    )
    args = parser.parse_args()
    for needed in (DOCS, WORDS):
        if not needed.exists():
            sys.exit(f"missing {needed}: apt-get install python3.11-doc wamerican")
    rng = random.Random(args.seed)
    prompts = [*doc_prompts(rng), *stdlib_prompts(rng), *word_prompts(rng)]
    splits: dict[str, dict[str, list[Prompt]]] = {"train": {}, "eval": {}}
    for prompt in prompts:
        side = "eval" if held_out(split_key(prompt)) else "train"
        splits[side].setdefault(prompt.domain, []).append(prompt)
    # The same text can come from two sources (a method name and docstring shared by two modules).
    eval_texts = {p.prompt for pool in splits["eval"].values() for p in pool}
    for domain, pool in splits["train"].items():
        splits["train"][domain] = [p for p in pool if p.prompt not in eval_texts]
    manifest: dict = {
        "seed": args.seed,
        "eval_percent_by_source": EVAL_PERCENT,
        "python": sys.version.split()[0],
        "debian_packages": package_versions(),
        "paths": {
            "python3.11-doc": str(DOCS),
            "wamerican": str(WORDS),
            "stdlib": sysconfig.get_paths()["stdlib"],
        },
        "counts": {},
    }
    for side, limit in (("train", args.train_per_domain), ("eval", args.eval_per_domain)):
        chosen: list[Prompt] = []
        for domain in sorted(splits[side]):
            pool = splits[side][domain]
            chosen += rng.sample(pool, min(limit, len(pool)))
            manifest["counts"][f"{side}/{domain}"] = {
                "available": len(pool),
                "written": len(pool) if side == "train" and not args.sampled_only else min(limit, len(pool)),
            }
        if side == "train":
            rng.shuffle(chosen)
            if not args.sampled_only:
                # Every other training prompt follows, in an order of its own generator: the sampled
                # prompts and the evaluation set stay what they were.
                taken = {id(p) for p in chosen}
                rest = [
                    p for domain in sorted(splits[side]) for p in splits[side][domain] if id(p) not in taken
                ]
                random.Random(f"{args.seed}/rest").shuffle(rest)
                chosen += rest
        path = args.out_dir / f"prompts_{side}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for prompt in chosen:
                f.write(json.dumps(asdict(prompt), ensure_ascii=False) + "\n")
        print(f"wrote {len(chosen)} prompts to {path}")
    (args.out_dir / "prompts_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
