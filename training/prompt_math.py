"""Math prompts: questions of DeepMind's mathematics_dataset generator (arithmetic, algebra, calculus,
probability, measurement, ...; pip package mathematics-dataset), as asked, wrapped in requests for
working or a bare answer, or as a conversation carrying an earlier question and its generated answer;
and word problems from scenario templates with drawn names and numbers."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from prompt_common import Prompt, conversation

# Share of generator modules (and of word-problem scenarios) held out: there are only a few dozen.
MATH_EVAL_PERCENT = 15
ASKS = (
    "{q}",
    "{q}",
    "{q}",
    "{q} Show your work.",
    "Solve step by step: {q}",
    "{q} Just give the final answer.",
    "I'm stuck on this homework question: {q}",
    "Explain how to solve this: {q}",
    "Can you check my reasoning? The question is: {q}",
    "Math question: {q}",
    "{q} Explain each step briefly.",
    "Please help. {q}",
)
FOLLOW_UPS = (
    "How did you get that?",
    "Can you show the steps?",
    "Thanks! Now this one: {q}",
    "Great. Next: {q}",
    "OK, and what about this? {q}",
    "Could you double-check that answer?",
    "Why does that method work?",
)
NAMES = (
    "Ava", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Kira", "Liam",
    "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe",
)  # fmt: skip


def _scenarios() -> dict[str, Callable[[random.Random, str], str]]:
    """Word-problem scenarios: name -> (rng, person) -> question."""
    r = random.Random  # for type hints in the lambdas below

    def shop(g: r, p: str) -> str:
        a, b, c = g.randint(2, 9), g.randint(2, 15), g.randint(20, 100)
        return (
            f"{p} buys {a} notebooks at ${b} each and pays with a ${c} bill. How much change does {p} get?"
            if a * b < c
            else f"{p} buys {a} notebooks at ${b} each. How much does {p} spend?"
        )

    def speed(g: r, p: str) -> str:
        v, t = g.randint(30, 120), g.randint(2, 9)
        return f"A train travels at {v} km/h for {t} hours and then {t // 2 + 1} more hours at {v - 10} km/h. How far does it go in all?"  # noqa: E501

    def recipe(g: r, p: str) -> str:
        cups, serves, want = g.randint(2, 6), g.choice((4, 6, 8)), g.choice((3, 10, 12, 18))
        return f"A recipe for {serves} people uses {cups} cups of flour. How much flour does {p} need to cook for {want} people?"  # noqa: E501

    def savings(g: r, p: str) -> str:
        s, w, goal = g.randint(5, 40), g.randint(10, 60), g.randint(150, 900)
        return f"{p} has ${s} saved and puts away ${w} every week. After how many weeks will {p} have at least ${goal}?"  # noqa: E501

    def discount(g: r, p: str) -> str:
        price, pct = g.randint(20, 400), g.choice((10, 15, 20, 25, 30, 40))
        return f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price?"

    def ages(g: r, p: str) -> str:
        a, d = g.randint(6, 20), g.randint(20, 35)
        return f"{p} is {a} years old and {p}'s mother is {a + d}. In how many years will the mother be exactly twice as old as {p}?"  # noqa: E501

    def garden(g: r, p: str) -> str:
        w, h = g.randint(3, 20), g.randint(3, 20)
        return f"{p}'s garden is a rectangle {w} m wide and {h} m long. How many metres of fence does {p} need to go around it, and what is its area?"  # noqa: E501

    def work(g: r, p: str) -> str:
        a, b = g.randint(2, 8), g.randint(3, 12)
        return f"{p} can paint a fence in {a} hours; a friend takes {b} hours. How long will it take if they paint it together?"  # noqa: E501

    def marbles(g: r, p: str) -> str:
        red, blue = g.randint(2, 12), g.randint(2, 12)
        return f"A bag holds {red} red and {blue} blue marbles. {p} draws two without looking. What is the probability that both are red?"  # noqa: E501

    def tickets(g: r, p: str) -> str:
        adult, child, n = g.randint(8, 20), g.randint(3, 7), g.randint(10, 60)
        return f"Adult tickets cost ${adult} and child tickets ${child}. {n} tickets were sold for ${adult * (n // 3) + child * (n - n // 3)} in all. How many adult tickets were sold?"  # noqa: E501

    def interest(g: r, p: str) -> str:
        money, rate, years = g.randint(500, 5000), g.choice((2, 3, 4, 5)), g.randint(2, 6)
        return f"{p} deposits ${money} at {rate}% interest compounded yearly. How much is in the account after {years} years?"  # noqa: E501

    def pages(g: r, p: str) -> str:
        total, per = g.randint(120, 600), g.randint(12, 45)
        return f"A book has {total} pages. {p} reads {per} pages a day. How many days will it take to finish, and how many pages are read on the last day?"  # noqa: E501

    def split_bill(g: r, p: str) -> str:
        bill, people, tip = g.randint(40, 300), g.randint(2, 8), g.choice((10, 15, 18, 20))
        return f"{p} and {people - 1} friends share a dinner bill of ${bill} and add a {tip}% tip. How much does each person pay?"  # noqa: E501

    def mixture(g: r, p: str) -> str:
        a, pa, pb = g.randint(2, 10), g.choice((10, 20, 30)), g.choice((50, 60, 80))
        return f"How many litres of a {pb}% juice mix must {p} add to {a} litres of a {pa}% mix to get a {(pa + pb) // 2}% mix?"  # noqa: E501

    def clock(g: r, p: str) -> str:
        h, m, d = g.randint(1, 11), g.choice((0, 15, 20, 35, 45)), g.randint(40, 300)
        return f"{p} starts baking at {h}:{m:02d} and the bread needs {d} minutes. When will it be ready?"

    def unit(g: r, p: str) -> str:
        miles = g.randint(3, 200)
        return f"{p} ran a race of {miles} miles. How many kilometres is that? (1 mile is about 1.609 km.)"

    def average(g: r, p: str) -> str:
        scores = [g.randint(55, 100) for _ in range(g.randint(3, 5))]
        return f"{p}'s test scores are {', '.join(map(str, scores))}. What score does {p} need on the next test to average 85?"  # noqa: E501

    def coins(g: r, p: str) -> str:
        n, total = g.randint(10, 40), g.randint(150, 600)
        return (
            f"{p} has {n} coins, all dimes and quarters, worth ${total / 100:.2f} in total. How many of each?"
        )

    def ratio(g: r, p: str) -> str:
        a, b, n = g.randint(1, 5), g.randint(2, 7), g.randint(20, 120)
        return f"In a class the ratio of cats to dogs owned is {a}:{b}. If there are {n} pets in all, how many are cats?"  # noqa: E501

    def stairs(g: r, p: str) -> str:
        n = g.randint(4, 12)
        return f"{p} climbs a staircase of {n} steps, taking one or two steps at a time. In how many different ways can {p} reach the top?"  # noqa: E501

    def fuel(g: r, p: str) -> str:
        km, use, price = g.randint(100, 900), g.choice((5, 6, 7, 8)), g.choice((1.6, 1.75, 1.9))
        return f"{p}'s car uses {use} litres per 100 km. Fuel costs {price} euros a litre. What does a {km} km trip cost?"  # noqa: E501

    def handshake(g: r, p: str) -> str:
        n = g.randint(5, 30)
        return f"At {p}'s party, each of the {n} guests shakes hands with every other guest once. How many handshakes are there?"  # noqa: E501

    return {f.__name__: f for f in (shop, speed, recipe, savings, discount, ages, garden, work, marbles,
                                     tickets, interest, pages, split_bill, mixture, clock, unit, average,
                                     coins, ratio, stairs, fuel, handshake)}  # fmt: skip


def word_problem_prompts(rng: random.Random, per_scenario: int = 120) -> Iterator[Prompt]:
    """Word problems: each scenario drawn `per_scenario` times, with a random way of asking."""
    for name, make in sorted(_scenarios().items()):
        key = f"word-problem:{name}"
        for n in range(per_scenario):
            question = make(rng, rng.choice(NAMES))
            yield Prompt(f"{key}#{n}", "math", rng.choice(ASKS).format(q=question), "build_prompts", key,
                         "math/word-problem")  # fmt: skip


def generator_modules() -> dict[str, Callable]:
    """mathematics_dataset's training modules by flat name (e.g. algebra__linear_1d)."""
    from mathematics_dataset.modules import modules

    flat: dict[str, Callable] = {}

    def add(tree: dict, prefix: str) -> None:
        for name, value in tree.items():
            full = f"{prefix}__{name}" if prefix else name
            if isinstance(value, dict):
                add(value, full)
            else:
                flat[full] = value

    add(modules.train(lambda range_: range_), "")
    return dict(sorted(flat.items()))


def generated_prompts(rng: random.Random, per_module: int = 160) -> Iterator[Prompt]:
    """Questions of every generator module, one in four a conversation with an earlier answered one."""
    import numpy as np

    np.random.seed(rng.randrange(2**31))
    random.seed(rng.randrange(2**31))  # the generator draws from the global generators

    def sample(module: Callable) -> tuple[str, str] | None:
        for _ in range(20):
            try:
                problem = module()
            except Exception:  # noqa: BLE001 - a few modules fail on some draws with newer libraries
                continue
            question, answer = str(problem.question), str(problem.answer)
            if len(question) <= 400 and len(answer) <= 60:
                return question, answer
        return None

    for name, module in generator_modules().items():
        key = f"mathematics-dataset:{name}"
        for n in range(per_module):
            drawn, earlier = sample(module), sample(module)
            if drawn is None or earlier is None:
                break  # a module that fails with the libraries installed
            question, pid = drawn[0], f"{key}#{n}"
            if rng.random() < 0.25:
                earlier_question, earlier_answer = earlier
                follow = rng.choice(FOLLOW_UPS).format(q=question)
                messages = conversation(rng.choice(ASKS).format(q=earlier_question), earlier_answer, follow)
                yield Prompt(pid, "math", follow, "mathematics-dataset", key, "math/multi-turn", messages)
            else:
                ask = rng.choice(ASKS).format(q=question)
                yield Prompt(pid, "math", ask, "mathematics-dataset", key, f"math/{name.split('__')[0]}")
