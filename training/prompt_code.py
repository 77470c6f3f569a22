"""Code prompts from the source of standard libraries that Debian ships: Go, Rust, Ruby, Perl, C (the
man pages' examples and synopses) and Python. One prompt per function, of a random kind: write it from
its documentation, complete it, explain it, fix a planted bug, translate it, review it, test it."""

from __future__ import annotations

import ast
import gzip
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prompt_common import Prompt, first_sentences, squash, styled

GO_SRC = Path("/usr/share/go-1.19/src")
RUST_SRC = Path("/usr/src/rustc-1.63.0/library")
RUBY_SRC = Path("/usr/lib/ruby/3.1.0")
PERL_SRC = Path("/usr/share/perl/5.36.0")
MAN_DIRS = (Path("/usr/share/man/man2"), Path("/usr/share/man/man3"))
# Standard-library areas that are tests, vendored tools or platform glue, not library code.
SKIP_MODULES = ("test", "idlelib", "lib2to3", "ensurepip", "turtledemo", "tkinter", "site-packages", "__")
LANGUAGES = (
    "Python",
    "Go",
    "Rust",
    "C",
    "C++",
    "Java",
    "JavaScript",
    "TypeScript",
    "Ruby",
    "Kotlin",
    "Swift",
)
FENCE = {"Go": "go", "Rust": "rust", "Ruby": "ruby", "Perl": "perl", "C": "c", "Python": "python"}


@dataclass
class Function:
    """A documented function of some language's library."""

    language: str
    name: str
    signature: str  # the declaration line(s), without the body
    code: str  # the whole definition
    summary: str  # its documentation's first sentences ("" when undocumented)


WRITE = (
    "Write a {lang} function `{name}` that does the following: {summary}",
    "Implement this in {lang}:\n\n```{fence}\n{signature}\n```\n\n{summary}",
    "In {lang}, how would I write a function called `{name}`? It should do this: {summary}",
    "I need a {lang} function with the signature `{signature}`. {summary} Can you write it?",
    "Write {lang} code for the following. {summary} Name the function `{name}` and add a short usage "
    "example.",
    "Could you implement `{name}` in {lang}? Spec: {summary}",
)
COMPLETE = (
    "Complete this {lang} function:\n\n```{fence}\n{partial}\n```",
    "Finish the implementation:\n\n```{fence}\n{partial}\n```",
    "Fill in the rest of this {lang} code.\n\n```{fence}\n{partial}\n```",
    "```{fence}\n{partial}\n```\n\nContinue the code above.",
)
EXPLAIN = (
    "Explain what this {lang} function does:\n\n```{fence}\n{code}\n```",
    "What does this {lang} code do? Go through it line by line.\n\n```{fence}\n{code}\n```",
    "Can you describe, in one paragraph, what `{name}` does?\n\n```{fence}\n{code}\n```",
    "I found this in a codebase. What is it for, and when would I call it?\n\n```{fence}\n{code}\n```",
    "```{fence}\n{code}\n```\n\nWhat is the time complexity of this, and why?",
)
FIX = (
    "This {lang} function has a bug. Find it and fix it.\n\n```{fence}\n{code}\n```",
    "Something is wrong with this code; it gives wrong results. What's the bug?\n\n```{fence}\n{code}\n```",
    "Debug this {lang} function:\n\n```{fence}\n{code}\n```",
    "My {lang} code doesn't behave as expected. Can you spot the mistake?\n\n```{fence}\n{code}\n```",
)
TRANSLATE = (
    "Translate this {lang} function into {target}:\n\n```{fence}\n{code}\n```",
    "Port the following {lang} code to {target}, keeping the behaviour the same.\n\n```{fence}\n{code}\n```",
    "How would this look in {target}?\n\n```{fence}\n{code}\n```",
    "Rewrite `{name}` in idiomatic {target}.\n\n```{fence}\n{code}\n```",
)
REVIEW = (
    "Review this {lang} code and suggest one improvement:\n\n```{fence}\n{code}\n```",
    "Do a code review of this function. Point out anything risky.\n\n```{fence}\n{code}\n```",
    "Write unit tests for this {lang} function:\n\n```{fence}\n{code}\n```",
    "Write a documentation comment for this {lang} function:\n\n```{fence}\n{code}\n```",
    "Refactor this to be more readable, and explain your changes.\n\n```{fence}\n{code}\n```",
    "What edge cases should I worry about in this code?\n\n```{fence}\n{code}\n```",
)
C_HOW_TO = (
    "How do I use `{name}()` in C? The man page says: {desc}.",
    "What does the C function `{name}` do ({desc}), and how do I call it correctly?",
    "Write a short C program that demonstrates `{name}()` ({desc}).",
    "Explain `{name}` from the C library: {desc}. What are its pitfalls?",
    "When would I use `{name}` in a C program? ({desc})",
    "Can you show an example of calling {name}() in C, with error handling?",
    "Quick C question: what does {name}() return, and what errors can it report?",
)
# Planted bugs: (pattern, replacement), the first that matches a function is applied once.
MUTATIONS = (
    (r" <= ", " < "),
    (r" < ", " <= "),
    (r" >= ", " > "),
    (r" == ", " != "),
    (r" != ", " == "),
    (r" && ", " || "),
    (r" \+ 1\b", " - 1"),
    (r" - 1\b", " + 1"),
    (r"\breturn true\b", "return false"),
    (r"\bTrue\b", "False"),
)


def function_prompt(rng: random.Random, fn: Function) -> tuple[str, str]:
    """(kind, prompt) for one function, the kind drawn at random among those it supports."""
    lang, fence = fn.language, FENCE[fn.language]
    fields = {"lang": lang, "fence": fence, "name": fn.name, "code": fn.code, "signature": fn.signature}
    kinds = ["explain", "translate", "review", "complete", "fix"]
    if fn.summary:
        kinds += ["write", "write"]
    for kind in rng.sample(kinds, len(kinds)):
        if kind == "write":
            return kind, styled(rng, rng.choice(WRITE).format(summary=fn.summary, **fields))
        if kind == "explain":
            return kind, rng.choice(EXPLAIN).format(**fields)
        if kind == "translate":
            target = rng.choice([t for t in LANGUAGES if t != lang])
            return kind, rng.choice(TRANSLATE).format(target=target, **fields)
        if kind == "review":
            return kind, rng.choice(REVIEW).format(**fields)
        if kind == "complete":
            lines = fn.code.splitlines()
            head = len(fn.signature.splitlines())
            if len(lines) - head >= 4:
                partial = "\n".join(lines[: head + rng.randrange(1, (len(lines) - head) // 2 + 1)])
                return kind, rng.choice(COMPLETE).format(partial=partial, **fields)
        if kind == "fix":
            body = fn.code[len(fn.signature) :]
            for pattern, repl in MUTATIONS:
                if re.search(pattern, body):
                    buggy = fn.signature + re.sub(pattern, repl, body, count=1)
                    return kind, rng.choice(FIX).format(**{**fields, "code": buggy})
    return "explain", rng.choice(EXPLAIN).format(**fields)


def brace_function(lines: list[str], start: int, indent: str) -> int | None:
    """Index of the line closing the brace-delimited definition starting at `start` (None if none)."""
    for i in range(start, min(len(lines), start + 60)):
        if lines[i] == indent + "}":
            return i
    return None


def comment_block(lines: list[str], end: int, marker: str) -> list[str]:
    """The comment lines (starting with `marker` after indentation) just above line `end`, marker cut."""
    out: list[str] = []
    i = end - 1
    while i >= 0 and lines[i].strip().startswith(marker):
        out.append(lines[i].strip()[len(marker) :].strip())
        i -= 1
    return out[::-1]


def doc_summary(doc_lines: list[str], limit: int = 300) -> str:
    """The first paragraph of documentation lines, markup reduced, cut to `limit` characters."""
    para: list[str] = []
    for line in doc_lines:
        if not line:
            if para:
                break
            continue
        para.append(line)
    text = squash(" ".join(para))
    text = re.sub(r"\[`?([^\]`]+)`?\]\([^)]*\)|\[`([^\]`]+)`\]", lambda m: m.group(1) or m.group(2), text)
    if not text or "```" in text or len(text) < 30:
        return ""
    return first_sentences(text, limit)


def fits(code: str) -> bool:
    """Whether a definition is a good size for a prompt."""
    return 4 <= code.count("\n") + 1 <= 40 and 80 <= len(code) <= 1400


def go_functions(path: Path) -> Iterator[Function]:
    """Exported, documented top-level functions and methods of a Go file."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"func (\([^)]*\) )?([A-Z]\w*)\(.*\{$", line)
        if not m:
            continue
        end = brace_function(lines, i, "")
        doc = comment_block(lines, i, "//")
        if end is None or not doc:
            continue
        code = "\n".join(lines[i : end + 1])
        if fits(code):
            yield Function("Go", m.group(2), line.removesuffix(" {"), code, doc_summary(doc))


def rust_functions(path: Path) -> Iterator[Function]:
    """Documented `pub fn`s of a Rust file (attributes of the standard library's own left out)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(\s*)pub (?:const )?(?:unsafe )?fn (\w+)\b.*\{$", line)
        if not m:
            continue
        end = brace_function(lines, i, m.group(1))
        j = i
        while j > 0 and lines[j - 1].strip().startswith("#["):
            j -= 1
        doc = comment_block(lines, j, "///")
        if end is None or not doc:
            continue
        code = textwrap.dedent("\n".join(lines[i : end + 1]))
        if fits(code) and "unsafe" not in line:
            yield Function(
                "Rust", m.group(2), code.splitlines()[0].removesuffix(" {"), code, doc_summary(doc)
            )


def ruby_functions(path: Path) -> Iterator[Function]:
    """Methods of a Ruby file (documented or not) with their comment's summary."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(\s*)def (?:self\.)?([a-z_]\w*[?!]?)", line)
        if not m:
            continue
        end = next((k for k in range(i + 1, min(len(lines), i + 60)) if lines[k] == m.group(1) + "end"), None)
        if end is None:
            continue
        code = textwrap.dedent("\n".join(lines[i : end + 1]))
        doc = [d for d in comment_block(lines, i, "#") if not d.startswith(("call-seq", ":"))]
        if fits(code):
            yield Function("Ruby", m.group(2), code.splitlines()[0], code, doc_summary(doc))


def perl_functions(path: Path) -> Iterator[Function]:
    """Top-level subs of a Perl module."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"sub ([a-zA-Z]\w*)\s*\{\s*$", line)
        if not m:
            continue
        end = brace_function(lines, i, "")
        if end is None:
            continue
        code = "\n".join(lines[i : end + 1])
        if fits(code) and "=cut" not in code and "=head" not in code:
            yield Function("Perl", m.group(1), line.rstrip(), code, doc_summary(comment_block(lines, i, "#")))


def python_functions(path: Path) -> Iterator[Function]:
    """Public, documented functions of a Python module."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        code = textwrap.dedent(ast.get_source_segment(text, node) or "")
        if doc and fits(code):
            signature = f"def {node.name}({ast.unparse(node.args)}):"
            yield Function("Python", node.name, signature, code, doc_summary(doc.splitlines()))


def roff_text(line: str) -> str:
    """A roff line's text: fonts, escapes and request names removed."""
    line = re.sub(r"^\.(?:B|I|BR|IR|RB|BI|IB|RI)\s+", "", line)
    line = re.sub(r"\\f(?:\[[^\]]*\]|\(..|.)", "", line)
    for a, b in (("\\-", "-"), ("\\e", "\\"), ("\\(aq", "'"), ("\\(dq", '"'), ("\\~", " "), ("\\&", "")):
        line = line.replace(a, b)
    line = re.sub(r"\\\[[a-z]+\]|\\\(..", "", line)
    return line.replace('"', "") if line.startswith(("B ", "I ")) else line


def man_page_prompts(rng: random.Random, path: Path) -> Iterator[tuple[str, str]]:
    """(kind, prompt) from a C man page: a how-to from its NAME line, and a task on its example program."""
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    if not any(line.startswith(".TH") and "Linux man-pages" in line for line in lines[:20]):
        return
    sections: dict[str, list[str]] = {}
    current = ""
    in_example = False
    for line in lines:
        if line.startswith(".SH"):
            current = line[3:].strip().strip('"')
            continue
        if line.startswith(".EX"):
            in_example = True
            sections.setdefault(current + "/code", []).append("")
            continue
        if line.startswith(".EE"):
            in_example = False
            continue
        if in_example:
            if not line.startswith((".", "'")):
                sections[current + "/code"][-1] += roff_text(line) + "\n"
        elif not line.startswith('.\\"'):
            sections.setdefault(current, []).append(roff_text(line))
    name_line = squash(" ".join(sections.get("NAME", [])))
    m = re.match(r"(.+?) - (.+)", name_line)
    if m:
        name = m.group(1).split(",")[0].strip()
        yield "how-to", styled(rng, rng.choice(C_HOW_TO).format(name=name, desc=m.group(2).rstrip(".")))
    programs = [c for c in sections.get("EXAMPLES/code", []) if "main(" in c and 200 <= len(c) <= 2500]
    if programs:
        code = programs[0].strip("\n")
        fn = Function("C", path.name.split(".")[0], code.splitlines()[0], code, "")
        kind, text = function_prompt(rng, fn)
        yield "program-" + kind, text


def files(root: Path, pattern: str, skip: tuple[str, ...] = ()) -> list[Path]:
    """Files under `root` matching `pattern`, sorted, none with a path part in `skip`."""
    if not root.exists():
        return []
    return [p for p in sorted(root.rglob(pattern)) if not set(p.relative_to(root).parts) & set(skip)]


def library_prompts(rng: random.Random) -> Iterator[Prompt]:
    """One prompt per function of the Go, Rust, Ruby, Perl and Python libraries, and per C man page."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    python = f"cpython-{sys.version.split()[0]}-stdlib"
    libraries = (
        ("golang-1.19-src", GO_SRC, "*.go", go_functions, ("testdata", "vendor", "cmd", "internal")),
        ("rust-src", RUST_SRC, "*.rs", rust_functions, ("tests", "benches", "stdarch", "portable-simd")),
        ("ruby3.1", RUBY_SRC, "*.rb", ruby_functions, ("bundler", "rubygems")),
        ("perl-modules-5.36", PERL_SRC, "*.pm", perl_functions, ()),
        (python, stdlib, "*.py", python_functions, SKIP_MODULES),
    )
    for package, root, pattern, extract, skip in libraries:
        for path in files(root, pattern, skip):
            rel = path.relative_to(root).as_posix()
            if path.name.endswith("_test.go") or rel.startswith(SKIP_MODULES) and package == python:
                continue
            if package == python and any(part.startswith(SKIP_MODULES) for part in rel.split("/")[:-1]):
                continue
            for fn in extract(path):
                kind, text = function_prompt(rng, fn)
                lang = fn.language.lower()
                yield Prompt(
                    f"{package}:{rel}:{fn.name}",
                    "code",
                    text,
                    f"{package}:{root / rel}",
                    f"{package}:{rel}",
                    f"code/{lang}/{kind}",
                )
    for man_dir in MAN_DIRS:
        for path in files(man_dir, "*.gz"):
            for n, (kind, text) in enumerate(man_page_prompts(rng, path)):
                yield Prompt(
                    f"manpages-dev:{path.name}#{n}",
                    "code",
                    text,
                    f"manpages-dev:{path}",
                    f"manpages-dev:{path.name}",
                    f"code/c/{kind}",
                )
