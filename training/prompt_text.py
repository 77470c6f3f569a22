"""Chat and prose prompts from human-written text that Debian ships: FAQs (Python, Debian, Perl, Git) as
multi-turn conversations with their real answers, manuals' paragraphs (Python, Debian reference, Git user
manual) as instructions and continuations, WordNet glosses, fortune quotes and dictionary words."""

from __future__ import annotations

import gzip
import random
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

from prompt_common import (
    FOLLOW_UPS,
    Prompt,
    conversation,
    head_of,
    held_out,
    passage_prompt,
    squash,
    styled,
)

PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
DEBIAN_FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz")
DEBIAN_REFERENCE = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
PERLFAQ = Path("/usr/share/perl/5.36.0/pod")
GIT_DOC = Path("/usr/share/doc/git-doc")
WORDNET = Path("/usr/share/wordnet")
FORTUNES = Path("/usr/share/games/fortunes")
WORDS = Path("/usr/share/dict/words")
# Python FAQ files whose questions are general conversation rather than programming.
CHAT_FAQS = ("faq/general.rst.txt", "faq/installed.rst.txt", "faq/windows.rst.txt")
FORTUNE_FILES = (
    "education", "food", "fortunes", "humorists", "kids", "literature", "love", "miscellaneous", "people",
    "pets", "platitudes", "science", "songs-poems", "sports", "wisdom", "work", "computers", "goedel",
    "riddles", "tao", "magic", "medicine", "law", "news", "paradoxum", "pratchett", "cookie",
)  # fmt: skip
ANSWER_LIMIT = 1200

QUESTION_WRAPPERS = (
    "{q}",
    "{q}",
    "Hi! {q}",
    "Quick question: {q}",
    "I've been wondering: {q}",
    "Can you help me with this? {q}",
    "{q} Thanks in advance.",
    "Question for you. {q}",
)
WORD_CHAT = (
    "What does the word '{w}' mean?",
    "Give me three example sentences that use the word '{w}'.",
    "Where does the word '{w}' come from?",
    "What are some synonyms and antonyms of '{w}'?",
    "How would you explain the word '{w}' to a ten-year-old?",
    "Is '{w}' a formal or an informal word? When would I use it?",
    "My friend used the word '{w}' in a message. What did they mean?",
    "Define '{w}' in one sentence.",
    "What's the {pos} '{w}' mean? I saw it in a book.",
    "Use '{w}' in a sentence about everyday life.",
)
WORD_FOLLOW_UPS = (
    "Can you use it in a sentence about cooking?",
    "Is there a simpler word that means the same?",
    "How is it pronounced?",
    "Does it have any other meanings?",
    "What's the opposite?",
    "Would it sound odd in casual conversation?",
    "Write a short dialogue where someone uses it.",
    "How would I translate that into French or Spanish?",
    "And how is it different from '{other}'?",
)
WORD_WRITING = (
    "Write a short story about {a} and {b}.",
    "Write a four-line poem about {a}.",
    "Write a paragraph describing {a} to someone who has never heard of it.",
    "Write a short letter to a friend that mentions {a} and {b}.",
    "Write the opening paragraph of a novel in which {a} plays an important role.",
    "Write a haiku that includes the words '{a}' and '{b}'.",
    "Write a product description for something called '{a}'.",
    "Write a dialogue between two characters arguing about {a}.",
    "Describe a day in the life of someone obsessed with {a}.",
    "Write a limerick about {a}.",
)
QUOTE_CHAT = (
    'What do you think this quote means?\n\n"{q}"',
    "Do you agree with this? Why or why not?\n\n{q}",
    "Someone sent me this:\n\n{q}\n\nIs it meant to be funny?",
    "Explain the joke or the point of this:\n\n{q}",
    'I keep thinking about this line: "{q}" What\'s the deeper idea?',
    "Can you give me a modern example that illustrates this saying?\n\n{q}",
)
QUOTE_ASKS = (
    "Tell me a short quote about {topic}.",
    "Share something witty about {topic}.",
    "Do you know a good saying about {topic}?",
    "Give me a quote to start my day, something on {topic}.",
    "I need a funny line about {topic} for a presentation.",
)
QUOTE_FOLLOW_UPS = (
    "What does it mean?",
    "Ha. Can you explain why that's funny?",
    "Give me another one in the same spirit.",
    "Who might have said that, and in what context?",
    "Can you turn that into a short poem?",
    "How could I use that in a speech?",
    "Do you think it's true?",
    "Rewrite it for a younger audience.",
)
QUOTE_PROSE = (
    "Write a short story inspired by this quote:\n\n{q}",
    "Write an essay of three paragraphs that opens with this line:\n\n{q}",
    "Turn this into a short poem:\n\n{q}",
    "Rewrite this in formal English:\n\n{q}",
    "Continue this text:\n\n{q}",
    "Write a scene in which a character says this:\n\n{q}",
    "Expand this into a paragraph for a blog post:\n\n{q}",
)


# Everyday questions about a concept ({x}; {y}: another of its kind), by WordNet's lexicographer file of
# the noun: what people ask an assistant most, and what the other chat sources hardly hold.
CONCEPT_ASKS = {
    "artifact": (
        "How does a {x} work?",
        "Explain how a {x} works in simple terms.",
        "What is a {x} used for?",
        "Give me three tips for choosing a good {x}.",
        "What are the pros and cons of a {x}?",
        "How do I take care of my {x} so it lasts longer?",
        "Write a short product description for a {x}.",
        "Who invented the {x}, and why was it important?",
        "What is the difference between a {x} and a {y}?",
    ),
    "phenomenon": (
        "Why does {x} happen?",
        "Explain {x} to a ten-year-old.",
        "What causes {x}?",
        "Describe {x} in simple terms.",
        "How does {x} affect everyday life?",
    ),
    "process": (
        "Explain the process of {x} step by step.",
        "What is {x}, and why does it matter?",
        "Describe {x} in simple terms.",
        "How does {x} work?",
    ),
    "event": (
        "What usually happens during a {x}?",
        "Describe a typical {x}.",
        "How should I prepare for a {x}?",
    ),
    "act": (
        "Give me three tips for {x}.",
        "How can I get better at {x}?",
        "What are the benefits of {x}?",
        "How do I get started with {x}?",
        "What are common mistakes people make with {x}?",
        "Make a simple weekly plan for someone who wants to try {x}.",
    ),
    "animal": (
        "Tell me three interesting facts about the {x}.",
        "Where does the {x} live, and what does it eat?",
        "Write a short poem about a {x}.",
        "How is a {x} different from a {y}?",
        "Describe the {x} for a children's book.",
    ),
    "plant": (
        "How do I grow {x} at home?",
        "Tell me three interesting facts about {x}.",
        "Describe {x} and where it grows.",
    ),
    "food": (
        "Give me a simple recipe that uses {x}.",
        "Is {x} healthy? Explain briefly.",
        "How is {x} made?",
        "What goes well with {x}?",
        "Describe the taste of {x} to someone who has never tried it.",
    ),
    "substance": (
        "What is {x} made of?",
        "What is {x} used for?",
        "Where does {x} come from?",
        "Is {x} dangerous? Explain briefly.",
        "What is the difference between {x} and {y}?",
    ),
    "abstract": (
        "What is {x}?",
        "Explain the concept of {x}.",
        "Why is {x} important?",
        "Write a short paragraph about {x}.",
        "How would you explain {x} to a child?",
        "What is the difference between {x} and {y}?",
    ),
    "person": (
        "What does a {x} do?",
        "What skills does a good {x} need?",
        "How do I become a {x}?",
        "Describe a day in the life of a {x}.",
    ),
    "place": (
        "Describe a typical {x}.",
        "What would I find in a {x}?",
        "Write a short scene set in a {x}.",
    ),
}
CONCEPT_FILES = {  # WordNet's noun lexicographer files (lexnames) -> the question kind above
    4: "act",
    5: "animal",
    6: "artifact",
    7: "abstract",
    9: "abstract",
    10: "abstract",
    11: "event",
    12: "abstract",
    13: "food",
    15: "place",
    18: "person",
    19: "phenomenon",
    20: "plant",
    22: "process",
    26: "abstract",
    27: "substance",
}
CONCEPT_MIN_TAGS = 1
CONCEPT_FOLLOW_UPS = (
    "Can you give me an example?",
    "Can you explain that more simply?",
    "Why does that matter?",
    "Tell me more.",
    "Can you sum that up in one sentence?",
    "What else should I know about it?",
)
CONCEPT_PROSE = (
    "Write a short story about a {x}.",
    "Write a haiku about {x}.",
    "Write a short poem about {x}.",
    "Write a paragraph describing {x} for a travel magazine.",
    "Write a short, funny dialogue about a {x}.",
)


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


def faq_prompt(rng: random.Random, question: str, answer: str) -> tuple[str, str, list | None]:
    """(kind, prompt, messages) of a FAQ entry: the question alone, or the question, its real answer and
    a follow-up."""
    asked = rng.choice(QUESTION_WRAPPERS).format(q=question)
    if answer and rng.random() < 0.6:
        follow = rng.choice(FOLLOW_UPS)
        return "faq-multi-turn", follow, conversation(asked, head_of(answer, ANSWER_LIMIT), follow)
    return "faq-question", styled(rng, asked), None


def python_doc_prompts(rng: random.Random) -> Iterator[Prompt]:
    """The Python documentation: FAQ entries, glossary terms, paragraphs and code examples."""
    for path in sorted(PY_DOCS.rglob("*.rst.txt")):
        rel = path.relative_to(PY_DOCS).as_posix()
        source, key = f"python3.11-doc:{path}", f"python3.11-doc:{rel}"
        blocks = list(rst_blocks(path))
        for n, (kind, text) in enumerate(blocks):
            pid = f"python3.11-doc:{rel}#{n}"
            if kind == "heading" and rel.startswith("faq/") and text.endswith("?"):
                answer = []
                for k, t in blocks[n + 1 :]:
                    if k == "heading":
                        break
                    answer.append(clean_rst(t) if k == "paragraph" else f"```python\n{t}\n```")
                domain = "chat" if rel in CHAT_FAQS else "code"
                fkind, prompt, messages = faq_prompt(rng, clean_rst(text), "\n\n".join(answer))
                lang = "" if domain == "chat" else "python/"
                yield Prompt(pid, domain, prompt, source, key, f"{domain}/{lang}{fkind}", messages)
            elif kind == "paragraph" and not rel.startswith(("faq/", "c-api/", "whatsnew/changelog")):
                plain = clean_rst(text).removesuffix(":")
                if 250 <= len(plain) <= 1000 and plain.count(" ") > 30:
                    pkind, prompt = passage_prompt(rng, plain)
                    yield Prompt(pid, "prose", prompt, source, key, f"prose/{pkind}")
            elif kind == "code" and not rel.startswith("c-api/"):
                code = text.replace("\t", "    ")
                foreign = code.lstrip().startswith(("$", "C:")) or any(
                    m in code for m in ("/*", "#include", "doctest:")
                )
                if 3 <= code.count("\n") + 1 <= 20 and 60 <= len(code) <= 800 and not foreign:
                    ask = rng.choice(
                        (
                            "What does this Python code do?",
                            "Explain this Python snippet step by step:",
                            "What would this print, and why?",
                            "Is there a more idiomatic way to write this?",
                        )
                    )
                    yield Prompt(
                        pid, "code", f"{ask}\n\n```python\n{code}\n```", source, key, "code/python/doc"
                    )


def numbered_sections(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(number, title, paragraphs) of a DocBook text rendering: "1.2. Title" headings at the margin,
    indented paragraphs separated by blank lines (code paragraphs kept as they are)."""
    number = title = ""
    paras: list[str] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        m = re.match(r"(\d+(?:\.\d+)+)\.\s(\S.*)", line)
        if m or not line.strip():
            if block:
                paras.append("\n".join(block))
                block = []
        if m:
            if number:
                yield number, title, paras
            number, title, paras = m.group(1), m.group(2), []
        elif line.startswith("    ") and number:
            block.append(line[4:])
        elif line.strip() and number and not paras and not block:
            title += " " + line.strip()  # a heading wrapped onto the next line
    if number:
        yield number, title, paras


def is_prose(paragraph: str) -> bool:
    """Whether an indented paragraph is running text (not code, a table or a list of names)."""
    return (
        not paragraph.startswith((" ", "$", "#", "*", "Note", "Tip", "Warning", "Caution"))
        and 200 <= len(paragraph) <= 1000
        and sum(c.isalpha() or c.isspace() for c in paragraph) > 0.8 * len(paragraph)
    )


def answer_text(paras: list[str]) -> str:
    """An answer's paragraphs: prose joined into lines, code kept."""
    return "\n\n".join(p if p.startswith((" ", "$", "#")) else squash(p) for p in paras)


def debian_doc_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Debian FAQ entries (chat, often multi-turn) and Debian Reference paragraphs (prose) and topics."""
    if DEBIAN_FAQ.exists():
        source = f"debian-faq:{DEBIAN_FAQ}"
        for number, title, paras in numbered_sections(gzip.open(DEBIAN_FAQ, "rt", encoding="utf-8").read()):
            question = squash(title)
            if question.endswith("?") and paras:
                kind, prompt, messages = faq_prompt(rng, question, answer_text(paras))
                key = f"debian-faq:{number}"
                yield Prompt(key, "chat", prompt, source, key, f"chat/{kind}", messages)
    if DEBIAN_REFERENCE.exists():
        source = f"debian-reference-en:{DEBIAN_REFERENCE}"
        text = gzip.open(DEBIAN_REFERENCE, "rt", encoding="utf-8").read()
        for number, title, paras in numbered_sections(text):
            key = f"debian-reference-en:{number}"
            for n, para in enumerate(p for p in paras if is_prose(p)):
                kind, prompt = passage_prompt(rng, squash(para))
                yield Prompt(f"{key}#{n}", "prose", prompt, source, key, f"prose/{kind}")
            topic = squash(title)
            if paras and 3 <= len(topic) <= 60 and not topic[0].isdigit():
                ask = rng.choice(
                    (
                        'In the context of Debian, what is meant by "{t}"?',
                        'Explain "{t}" on a Debian system.',
                        "I'm new to Linux. Can you tell me about {t}?",
                        "Give me an overview of {t} in Debian.",
                    )
                )
                yield Prompt(key, "chat", styled(rng, ask.format(t=topic)), source, key, "chat/topic")


def pod_text(text: str) -> str:
    """Plain text of POD: formatting codes reduced to their words, verbatim blocks kept as code."""
    text = re.sub(r"E<gt>", ">", re.sub(r"E<lt>", "<", text))
    for _ in range(2):
        text = re.sub(r"[CIBFSL]<<+\s(.*?)\s>>+", r"\1", text)
        text = re.sub(r"[CIBFSLX]<([^<>]*)>", r"\1", text)
    text = re.sub(r"L<[^|>]*\|([^>]*)>", r"\1", text)
    return text


def perlfaq_prompts(rng: random.Random) -> Iterator[Prompt]:
    """perlfaq entries (perl-doc) as code conversations: the question, its real answer, a follow-up."""
    for path in sorted(PERLFAQ.glob("perlfaq[1-9].pod")):
        source = f"perl-doc:{path}"
        parts = re.split(r"^=head2 (.+)$", path.read_text(encoding="utf-8", errors="replace"), flags=re.M)
        for question, body in zip(parts[1::2], parts[2::2], strict=True):
            body = body.split("\n=head1")[0]
            paras = []
            for para in body.strip().split("\n\n"):
                if para.startswith("="):
                    continue
                code = para.startswith((" ", "\t"))
                paras.append(textwrap.dedent(para) if code else squash(pod_text(para)))
            key = f"perl-doc:{path.stem}:{squash(question)}"
            kind, prompt, messages = faq_prompt(rng, squash(pod_text(question)), "\n\n".join(paras))
            yield Prompt(key, "code", prompt, source, key, f"code/perl/{kind}", messages)


def git_doc_prompts(rng: random.Random) -> Iterator[Prompt]:
    """gitfaq entries (chat) and Git user-manual paragraphs (prose), from git-doc."""
    faq = GIT_DOC / "gitfaq.txt"
    if faq.exists():
        text = faq.read_text(encoding="utf-8")
        for m in re.finditer(
            r"^(\S[^\n]*\?)::\n((?:[\t+][^\n]*\n|[^\n\[][^\n]*\n|\n)+?)(?=\[\[|^=)", text, re.M
        ):
            answer = "\n\n".join(squash(p.strip("+\n")) for p in re.split(r"\n\+\n|\n\n", m.group(2)))
            key = f"git-doc:gitfaq:{m.group(1)}"
            kind, prompt, messages = faq_prompt(rng, m.group(1).replace("`", "'"), answer.strip())
            yield Prompt(key, "chat", prompt, f"git-doc:{faq}", key, f"chat/{kind}", messages)
    manual = GIT_DOC / "user-manual.txt"
    if manual.exists():
        section = "intro"
        for n, para in enumerate(manual.read_text(encoding="utf-8").split("\n\n")):
            heading = re.search(r"^=+ (.+)$", para, re.M)
            if heading:
                section = heading.group(1)
                continue
            plain = squash(
                re.sub(r"<<[^,>]*,([^>]*)>>|linkgit:([\w-]+)\[\d\]", lambda m: m.group(1) or m.group(2), para)
            )
            if 200 <= len(plain) <= 1000 and not para.startswith(("-", "$", " ", "\t", "[", "*", ".")):
                key = f"git-doc:user-manual:{section}"
                kind, prompt = passage_prompt(rng, plain)
                yield Prompt(f"{key}#{n}", "prose", prompt, f"git-doc:{manual}", key, f"prose/{kind}")


def wordnet_senses() -> dict[str, list[tuple[str, str, list[str], list[str]]]]:
    """Lemma -> [(part of speech, definition, examples, synonyms)] from WordNet's data files."""
    senses: dict[str, list] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (WORDNET / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(" ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            count = int(parts[3], 16)
            lemmas = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * count : 2]]
            pieces = [p.strip() for p in gloss.split(";")]
            definition = pieces[0]
            examples = [p.strip('"') for p in pieces[1:] if p.startswith('"') and p.endswith('"')]
            for lemma in lemmas:
                if re.fullmatch(r"[a-z]{3,15}", lemma):
                    senses.setdefault(lemma, []).append((pos, definition, examples, lemmas))
    return senses


def wordnet_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Word questions answered by WordNet glosses (multi-turn with a follow-up), and story openings from
    its example sentences; one word, one key, shared with the dictionary words."""
    source = f"wordnet-base:{WORDNET}"
    pos_names = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    for word, word_senses in sorted(wordnet_senses().items()):
        key = f"word:{word}"
        pos, definition, examples, lemmas = rng.choice(word_senses)
        others = [w for w in lemmas if w != word and re.fullmatch(r"[a-z]{3,15}", w)]
        others = [w for w in others if held_out(f"word:{w}") == held_out(key)]
        ask = rng.choice(WORD_CHAT).format(w=word, pos=pos_names[pos])
        r = rng.random()
        if r < 0.45:
            answer = f"'{word.capitalize()}' ({pos_names[pos]}) means {definition}."
            if examples:
                answer += f' For example: "{examples[0]}".'
            if others:
                answer += f" A close synonym is '{others[0]}'."
            follow = rng.choice(WORD_FOLLOW_UPS[:-1] if not others else WORD_FOLLOW_UPS)
            follow = follow.format(other=others[-1] if others else "")
            messages = conversation(ask, answer, follow)
            yield Prompt(f"wordnet:{word}", "chat", follow, source, key, "chat/word-multi-turn", messages)
        elif r < 0.75:
            yield Prompt(f"wordnet:{word}", "chat", styled(rng, ask), source, key, "chat/word")
        elif examples and len(examples[0].split()) >= 5:
            line = examples[0][0].upper() + examples[0][1:]
            task = rng.choice(
                (
                    'Write a short story that begins with: "{s}"',
                    "Continue this: {s}",
                    'Use this sentence as the first line of a poem: "{s}"',
                    'Write a paragraph that ends with the sentence "{s}"',
                )
            ).format(s=line)
            yield Prompt(f"wordnet:{word}:example", "prose", task, source, key, "prose/example-sentence")


def fortunes() -> Iterator[tuple[str, int, str]]:
    """(file, index, text) of the fortune cookies of the chosen files, ASCII art and long ones left out."""
    for name in FORTUNE_FILES:
        path = FORTUNES / name
        if not path.exists():
            continue
        for n, text in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n%\n")):
            text = text.strip("\n")
            letters = sum(c.isalpha() or c.isspace() for c in text)
            if 40 <= len(text) <= 700 and letters > 0.8 * len(text) and "  " * 6 not in text:
                yield name, n, text


def fortune_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Quotes and literary bits from the fortunes packages: discussed (chat, sometimes as the assistant's
    earlier turn) or continued and reworked (prose)."""
    for name, n, text in fortunes():
        key = f"fortunes:{name}:{n}"
        source = f"fortunes:{FORTUNES / name}"
        topic = {"songs-poems": "songs", "miscellaneous": "life", "fortunes": "life", "cookie": "life"}.get(
            name, name
        )
        r = rng.random()
        if r < 0.3:
            yield Prompt(key, "chat", rng.choice(QUOTE_CHAT).format(q=text), source, key, "chat/quote")
        elif r < 0.55:
            follow = rng.choice(QUOTE_FOLLOW_UPS)
            messages = conversation(rng.choice(QUOTE_ASKS).format(topic=topic), text, follow)
            yield Prompt(key, "chat", follow, source, key, "chat/quote-multi-turn", messages)
        else:
            flat = squash(text)
            if len(flat) > 200 and rng.random() < 0.5:
                kind, prompt = passage_prompt(rng, flat)
            else:
                kind, prompt = "quote", rng.choice(QUOTE_PROSE).format(q=text)
            yield Prompt(key, "prose", prompt, source, key, f"prose/{kind}")


def word_prompts(rng: random.Random, count: int = 3000) -> Iterator[Prompt]:
    """Writing tasks built from dictionary words (a pair of words is drawn from one side)."""
    words = sorted({w for w in WORDS.read_text(encoding="utf-8").split() if re.fullmatch(r"[a-z]{4,12}", w)})
    sides = {
        True: [w for w in words if held_out(f"word:{w}")],
        False: [w for w in words if not held_out(f"word:{w}")],
    }
    source = f"wamerican:{WORDS}"
    for a in rng.sample(words, count):
        b = rng.choice(sides[held_out(f"word:{a}")])
        prompt = rng.choice(WORD_WRITING).format(a=a, b=b)
        yield Prompt(f"wamerican:{a}:{b}", "prose", prompt, source, f"word:{a}", "prose/words")


def concept_nouns() -> dict[str, list[tuple[str, str, str]]]:
    """Question kind -> [(lemma, definition, its synset's id)] for WordNet nouns of the lexicographer files
    in CONCEPT_FILES whose sense there is common: tagged at least CONCEPT_MIN_TAGS times in WordNet's
    sense-tagged corpus (`cntlist.rev`; "tooth" is tagged as a body part, not as an act)."""
    tagged = set()  # (lemma, lexicographer file) of common noun senses
    for line in (WORDNET / "cntlist.rev").read_text(encoding="utf-8", errors="replace").splitlines():
        sense_key, _, count = line.split(" ")
        lemma, sense = sense_key.split("%", 1)
        pos, lexfile = sense.split(":")[:2]
        if pos == "1" and int(count) >= CONCEPT_MIN_TAGS:
            tagged.add((lemma, int(lexfile)))
    kinds: dict[str, list[tuple[str, str, str]]] = {}
    seen = set()
    for line in (WORDNET / "data.noun").read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(" ") or "|" not in line:
            continue
        fields, gloss = line.split("|", 1)
        parts = fields.split()
        kind = CONCEPT_FILES.get(int(parts[1]))
        if kind is None:
            continue
        count = int(parts[3], 16)
        for raw in parts[4 : 4 + 2 * count : 2]:
            lemma = re.sub(r"\(.*\)$", "", raw)
            common = (lemma, int(parts[1])) in tagged and lemma not in seen
            if common and re.fullmatch(r"[a-z]{3,15}(_[a-z]{2,12}){0,2}", lemma):
                seen.add(lemma)
                definition = gloss.split(";")[0].strip()
                kinds.setdefault(kind, []).append((lemma.replace("_", " "), definition, parts[0]))
    return kinds


def concept_prompts(rng: random.Random) -> Iterator[Prompt]:
    """Everyday questions about common concepts (how a thing works, why something happens, tips, facts,
    recipes, comparisons), some as a conversation whose first answer is the WordNet gloss, and a few
    writing tasks; a concept's key is its word's, shared with the other word prompts."""
    source = f"wordnet-base/concepts:{WORDNET}"
    for kind, nouns in sorted(concept_nouns().items()):
        for lemma, definition, synset in nouns:
            key = f"word:{lemma}"
            side = [n for n, _, _ in nouns if n != lemma and held_out(f"word:{n}") == held_out(key)]
            other = rng.choice(side) if side else lemma
            ask = rng.choice(CONCEPT_ASKS[kind]).format(x=lemma, y=other)
            r = rng.random()
            pid = f"concept:{synset}:{lemma}"
            if r < 0.7:
                yield Prompt(pid, "chat", styled(rng, ask), source, key, f"chat/concept-{kind}")
            elif r < 0.88:
                answer = f"{lemma[0].upper() + lemma[1:]}: {definition}."
                messages = conversation(ask, answer, rng.choice(CONCEPT_FOLLOW_UPS))
                follow = messages[-1]["content"]
                yield Prompt(pid, "chat", follow, source, key, "chat/concept-multi-turn", messages)
            else:
                task = rng.choice(CONCEPT_PROSE).format(x=lemma)
                yield Prompt(pid, "prose", task, source, key, "prose/concept")
