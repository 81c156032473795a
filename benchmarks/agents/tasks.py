"""Three toy agent tasks with seeded prompt generators and exact, verifiable rewards.

They echo the paper's domains: `math` (arithmetic, the coding/maths agent),
`tool` (emit the right function call as JSON) and `recall` (return the value
stored under a key in a long-ish context, the memory agent). Train and test
prompts come from one generator and are split by a hash of the prompt, so the
held-out set never overlaps the training set whatever the seeds.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import random
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt (the user turn) and what a correct reply must contain."""

    prompt: str
    answer: Any


@dataclass(frozen=True)
class Task:
    """A prompt generator and a scorer; reward is in [0, 1], 1 only when correct.

    `answered(text)` holds once the text already carries everything the scorer
    reads (evaluation stops generating there); None: only EOS ends a reply."""

    name: str
    make: Callable[[random.Random], Example]
    reward: Callable[[Example, str], float]
    answered: Callable[[str], bool] | None = None

    def correct(self, example: Example, completion: str) -> bool:
        return self.reward(example, completion) == 1.0


def _first_int(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return None if match is None else int(match.group())


def _make_math(rng: random.Random) -> Example:
    a, b = rng.randint(2, 49), rng.randint(2, 49)
    if rng.random() < 0.5:
        return Example(f"What is {a} + {b}? End with the result.", a + b)
    a, b = max(a, b), min(a, b)
    return Example(f"What is {a} - {b}? End with the result.", a - b)


def _score_math(example: Example, completion: str) -> float:
    """The last integer written is the answer (working may come before it)."""
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and int(numbers[-1]) == example.answer else 0.0


CITIES = (
    "Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dublin", "Hanoi",
    "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw", "Athens", "Dakar",
    "Nairobi", "Accra", "Tunis", "Delhi", "Seoul", "Manila", "Jakarta", "Bangkok",
    "Sydney", "Perth", "Toronto", "Denver", "Boston", "Miami", "Havana", "Bogota",
    "Santiago", "Caracas", "Montreal", "Chicago", "Seattle", "Houston", "Zurich",
    "Riga",
)  # fmt: skip
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF")


def call_form(call: dict) -> str:
    """The call's shape with a typed placeholder per argument, e.g.
    `{"name": "set_timer", "arguments": {"minutes": <minutes>}}`: strings in
    quotes, integers bare. (A form with concrete example values was copied:
    the agents learned one argument and kept the example's other values.)"""
    arguments = ", ".join(
        f'"{key}": "<{key}>"' if isinstance(value, str) else f'"{key}": <{key}>'
        for key, value in call["arguments"].items()
    )
    return f'{{"name": "{call["name"]}", "arguments": {{{arguments}}}}}'


def _make_tool(rng: random.Random) -> Example:
    kind = rng.randrange(3)
    if kind == 0:
        city = rng.choice(CITIES)
        request = rng.choice(
            (
                f"What is the weather in {city}?",
                f"Is it raining in {city} today?",
                f"How warm is it in {city} right now?",
            )
        )
        call = {"name": "get_weather", "arguments": {"city": city}}
    elif kind == 1:
        minutes = rng.randint(2, 99)
        request = rng.choice(
            (
                f"Set a timer for {minutes} minutes.",
                f"Remind me in {minutes} minutes.",
                f"Start a {minutes} minute countdown.",
            )
        )
        call = {"name": "set_timer", "arguments": {"minutes": minutes}}
    else:
        amount = rng.randint(5, 500)
        source, target = rng.sample(CURRENCIES, 2)
        request = f"How much is {amount} {source} in {target}?"
        call = {
            "name": "convert_currency",
            "arguments": {"amount": amount, "source": source, "target": target},
        }
    prompt = (
        f"Call the function {call['name']} for this request: {request}\n"
        "Answer with only the JSON call, in this form:\n"
        f"{call_form(call)}"
    )
    return Example(prompt, call)


def _json_object(text: str) -> Any:
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _end = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _score_tool(example: Example, completion: str) -> float:
    """1 for the exact call (key order and spacing free, values exact); partial
    credit on the way there, so copying the prompt's example is not a plateau:
    a JSON object with `name` and `arguments` 0.2, the right name 0.4, the
    right argument names 0.6 plus 0.4 × the share of argument values right."""
    call = _json_object(completion)
    if call is None or not {"name", "arguments"} <= call.keys():
        return 0.0
    if call == example.answer:
        return 1.0
    if call["name"] != example.answer["name"]:
        return 0.2
    arguments, wanted = call["arguments"], example.answer["arguments"]
    if not isinstance(arguments, dict) or arguments.keys() != wanted.keys():
        return 0.4
    right = sum(arguments[key] == value for key, value in wanted.items())
    return 0.6 + 0.4 * right / len(wanted)


KEYS = (
    "apple",
    "river",
    "tiger",
    "cloud",
    "stone",
    "maple",
    "piano",
    "lemon",
    "eagle",
    "amber",
    "coral",
    "delta",
    "falcon",
    "harbor",
    "ivory",
    "jungle",
)


def _make_recall(rng: random.Random) -> Example:
    records = {key: rng.randint(1000, 9999) for key in rng.sample(KEYS, 6)}
    key = rng.choice(list(records))
    lines = "\n".join(f"{k} = {v}" for k, v in records.items())
    prompt = (
        f"Memory:\n{lines}\n\nWhat number is stored under {key}? "
        "Reply with the number only."
    )
    return Example(prompt, records[key])


def _int_closed(text: str) -> bool:
    """An integer has been written and something other than a digit follows it."""
    return re.search(r"\d\D", text) is not None


def _score_recall(example: Example, completion: str) -> float:
    return 1.0 if _first_int(completion) == example.answer else 0.0


TASKS = {
    task.name: task
    for task in (
        Task("math", _make_math, _score_math),
        Task(
            "tool", _make_tool, _score_tool, lambda text: _json_object(text) is not None
        ),
        Task("recall", _make_recall, _score_recall, _int_closed),
    )
}


SPLITS = ("train", "validation", "test")


def split_of(prompt: str) -> str:
    """A prompt's split from its hash: 1 in 5 test, 1 in 5 validation, rest train."""
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 5
    return {0: "test", 1: "validation"}.get(bucket, "train")


def examples(task: Task, split: str, seed: int) -> Iterator[Example]:
    """Endless distinct examples of one split (see SPLITS), seeded."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    rng = random.Random(f"{task.name}:{split}:{seed}")
    seen: set[str] = set()
    while True:
        example = task.make(rng)
        if example.prompt in seen or split_of(example.prompt) != split:
            continue
        seen.add(example.prompt)
        yield example


def take(task: Task, split: str, seed: int, count: int) -> list[Example]:
    iterator = examples(task, split, seed)
    return [next(iterator) for _ in range(count)]


def _code(function: Callable) -> str:
    """A function's syntax tree without its docstring: what it does, not how
    its text is formatted or documented."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0].body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    ):
        del body[0]
    return ast.dump(tree)


def fingerprint(task: Task, max_new_tokens: int) -> str:
    """Changes when the task's prompts, scoring or answer length change (keys the
    pipeline's cache, which cannot see code changes otherwise)."""
    source = "".join(_code(code) for code in (task.make, task.reward, split_of))
    prompts = "".join(e.prompt for e in take(task, "test", 0, 20))
    text = f"{source}{prompts}{max_new_tokens}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
