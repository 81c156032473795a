"""Three toy agent tasks with seeded prompt generators and exact, verifiable rewards.

They echo the paper's domains: `math` (arithmetic, the coding/maths agent),
`tool` (emit the right function call as JSON) and `recall` (return the value
stored under a key in a long-ish context, the memory agent). Train and test
prompts come from one generator and are split by a hash of the prompt, so the
held-out set never overlaps the training set whatever the seeds.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
import re
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
    """A prompt generator and a scorer; reward is in [0, 1], 1 only when correct."""

    name: str
    make: Callable[[random.Random], Example]
    reward: Callable[[Example, str], float]

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


CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Dublin", "Hanoi")
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF")
TOOL_LIST = (
    "get_weather(city)\nset_timer(minutes)\nconvert_currency(amount, source, target)"
)


TOOL_EXAMPLES = (
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    '{"name": "set_timer", "arguments": {"minutes": 10}}\n'
    '{"name": "convert_currency", "arguments": '
    '{"amount": 20, "source": "USD", "target": "EUR"}}'
)


def _make_tool(rng: random.Random) -> Example:
    kind = rng.randrange(3)
    if kind == 0:
        city = rng.choice(CITIES)
        request = rng.choice(
            (f"What is the weather in {city}?", f"Is it raining in {city} today?")
        )
        call = {"name": "get_weather", "arguments": {"city": city}}
    elif kind == 1:
        minutes = rng.randint(2, 90)
        request = rng.choice(
            (f"Set a timer for {minutes} minutes.", f"Remind me in {minutes} minutes.")
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
        f"Functions:\n{TOOL_LIST}\n\nRequest: {request}\n"
        "Answer with only a JSON call, like these examples:\n"
        f"{TOOL_EXAMPLES}"
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
    """1 for the exact call; partial credit on the way there: a JSON object with
    `name` and `arguments` 0.25, the right name 0.5, right argument names 0.75."""
    call = _json_object(completion)
    if call is None or not {"name", "arguments"} <= call.keys():
        return 0.0
    if call == example.answer:
        return 1.0
    if call["name"] != example.answer["name"]:
        return 0.25
    arguments = call["arguments"]
    same_keys = isinstance(arguments, dict) and (
        arguments.keys() == example.answer["arguments"].keys()
    )
    return 0.75 if same_keys else 0.5


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


def _score_recall(example: Example, completion: str) -> float:
    return 1.0 if _first_int(completion) == example.answer else 0.0


TASKS = {
    task.name: task
    for task in (
        Task("math", _make_math, _score_math),
        Task("tool", _make_tool, _score_tool),
        Task("recall", _make_recall, _score_recall),
    )
}


def _is_test(prompt: str, test_share: int = 5) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % test_share == 0


def examples(task: Task, split: str, seed: int) -> Iterator[Example]:
    """Endless distinct examples of one split ('train' or 'test'), seeded."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(f"{task.name}:{split}:{seed}")
    seen: set[str] = set()
    while True:
        example = task.make(rng)
        if example.prompt in seen or _is_test(example.prompt) != (split == "test"):
            continue
        seen.add(example.prompt)
        yield example


def take(task: Task, split: str, seed: int, count: int) -> list[Example]:
    iterator = examples(task, split, seed)
    return [next(iterator) for _ in range(count)]


def fingerprint(task: Task, max_new_tokens: int) -> str:
    """Changes when the task's prompts, scoring or answer length change (keys the
    pipeline's cache, which cannot see code changes otherwise)."""
    source = inspect.getsource(task.make) + inspect.getsource(task.reward)
    prompts = "".join(e.prompt for e in take(task, "test", 0, 20))
    text = f"{source}{prompts}{max_new_tokens}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
