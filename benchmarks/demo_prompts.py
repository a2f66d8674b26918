"""Write the demo drafter's prompt set: licence-clean prompts we build ourselves.

Sources: templates and word lists written here, and paragraphs of Python's own reference text
(`pydoc_data.topics`, PSF licence, shipped with every Python). Deterministic (seeded), so the
files in dflash_cli/assets/ can be rebuilt exactly (tests/loading/test_gguf.py checks it):

    python scripts/make_demo_prompts.py dflash_cli/assets

No torch and no other dflash_cli module here: the prompts are plain text for `dflash train`.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import random
import re
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts"

SUBJECTS = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "volcanoes",
    "earthquakes",
    "the moon",
    "gravity",
    "electricity",
    "magnetism",
    "climate change",
    "recycling",
    "the human heart",
    "the immune system",
    "sleep",
    "vitamins",
    "exercise",
    "coffee",
    "tea",
    "chocolate",
    "bread",
    "cheese",
    "honey",
    "bees",
    "dolphins",
    "elephants",
    "owls",
    "cats",
    "dogs",
    "horses",
    "penguins",
    "rainforests",
    "deserts",
    "oceans",
    "rivers",
    "mountains",
    "glaciers",
    "the Roman Empire",
    "ancient Egypt",
    "the printing press",
    "the steam engine",
    "the internet",
    "computers",
    "smartphones",
    "robots",
    "artificial intelligence",
    "machine learning",
    "databases",
    "encryption",
    "passwords",
    "email",
    "music",
    "jazz",
    "painting",
    "photography",
    "chess",
    "football",
    "the Olympic Games",
    "bicycles",
    "trains",
    "airplanes",
    "rockets",
    "satellites",
    "the solar system",
    "Mars",
    "stars",
    "rainbows",
    "thunderstorms",
    "snow",
    "friendship",
    "kindness",
    "time management",
    "saving money",
    "budgeting",
    "learning a language",
    "reading books",
    "writing essays",
    "public speaking",
    "gardening",
    "cooking pasta",
    "baking cookies",
    "camping",
    "hiking",
    "swimming",
    "meditation",
    "healthy breakfast",
    "drinking water",
    "the alphabet",
    "prime numbers",
    "fractions",
    "percentages",
    "geometry",
    "triangles",
    "the Pythagorean theorem",
    "probability",
    "statistics",
    "renewable energy",
    "solar panels",
    "wind turbines",
    "batteries",
    "electric cars",
    "libraries",
    "museums",
    "maps",
]

ACTIVITIES = [
    "studying for an exam",
    "staying focused",
    "sleeping better",
    "starting to run",
    "learning to cook",
    "keeping a plant alive",
    "writing clean code",
    "preparing for a job interview",
    "making new friends",
    "traveling on a budget",
    "reducing stress",
    "organizing a small room",
    "learning to play guitar",
    "taking better photos",
    "saving energy at home",
    "giving a presentation",
    "reading more books",
    "drinking more water",
    "learning Python",
    "debugging a program",
    "writing a resume",
    "planning a birthday party",
    "taking care of a puppy",
    "riding a bicycle safely",
    "staying warm in winter",
]

CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the factorial of n",
    "computes the n-th Fibonacci number",
    "counts the vowels in a string",
    "finds the largest element of a list",
    "removes duplicates from a list",
    "checks whether a string is a palindrome",
    "merges two sorted lists",
    "sorts a list of dictionaries by a key",
    "converts Celsius to Fahrenheit",
    "returns the sum of the digits of a number",
    "flattens a nested list",
    "counts word frequencies in a text",
    "checks whether two strings are anagrams",
    "returns the greatest common divisor of two numbers",
    "reads a file and returns its lines",
    "finds the second largest number in a list",
    "capitalizes every word in a sentence",
    "computes the average of a list of numbers",
    "returns all even numbers from a list",
    "checks whether a year is a leap year",
    "converts a binary string to an integer",
    "finds the longest word in a sentence",
    "returns the intersection of two lists",
    "implements binary search",
    "implements bubble sort",
    "computes the power set of a list",
    "validates an email address with a simple rule",
    "transposes a matrix",
    "counts the lines in a file",
    "generates the first n prime numbers",
    "returns the median of a list",
    "rotates a list by k positions",
    "chunks a list into groups of size n",
    "converts a dictionary to a list of tuples",
]

SUBJECT_TEMPLATES = [
    "What is {s}?",
    "Explain {s} in simple terms.",
    "Tell me about {s}.",
    "Write a short poem about {s}.",
    "Give me three interesting facts about {s}.",
    "Why is {s} important?",
    "Write a short story about {s}.",
    "Explain {s} to a ten-year-old.",
    "Write a haiku about {s}.",
    "What are the main ideas behind {s}?",
    "Describe {s} in one paragraph.",
    "What should a beginner know about {s}?",
]
ACTIVITY_TEMPLATES = [
    "Give me some tips for {a}.",
    "How can I get better at {a}?",
    "What are common mistakes when {a}?",
    "Make a simple plan for {a}.",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a function in Python that {t}, with a docstring.",
    "Show me Python code that {t}, and explain it.",
]
PYTHON_TEMPLATES = [
    "Explain the Python '{k}' topic.",
    "How does '{k}' work in Python? Give an example.",
    "What is '{k}' in Python?",
]
CHAT = [
    "Hello!",
    "Hi, who are you?",
    "Tell me a joke.",
    "What can you do?",
    "Good morning! How are you?",
    "Tell me something interesting.",
    "Can you help me with my homework?",
    "What is the meaning of life?",
    "Recommend a good book.",
    "What is your favorite color?",
    "Write a limerick about a cat.",
    "Say something nice.",
    "What day comes after Monday?",
    "How many days are in a year?",
    "What is 12 times 12?",
    "Name five fruits.",
    "List the planets of the solar system.",
    "Write a thank-you note to a teacher.",
    "Write an email asking for a day off.",
    "Translate 'good morning' into French.",
]


# The second batch (added when the first 2048 answers proved too few: the drafter memorized them): more templates,
# and arithmetic word problems with seeded numbers, which the first batch lacked entirely.
MORE_SUBJECT_TEMPLATES = [
    "Write a short paragraph about {s}.",
    "List five key points about {s}.",
    "What are the pros and cons of {s}?",
    "How would you teach {s} to a friend?",
    "What is a common misconception about {s}?",
    "Summarize the history of {s} in a few sentences.",
]
MORE_CODE_TEMPLATES = [
    "Write a Python function that {t}, and add type hints.",
    "Write a Python function that {t}. Include a short example call.",
    "Using only a loop, write Python code that {t}.",
    "Write a Python function that {t}, and a unit test for it.",
]
MORE_ACTIVITY_TEMPLATES = [
    "What is the best way to start {a}?",
    "Write a checklist for {a}.",
    "Explain why {a} is hard for many people.",
]
ITEMS = ["apples", "pencils", "notebooks", "tickets", "cookies", "stamps", "marbles", "books", "oranges", "candles"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
MATH_TEMPLATES = [
    "{n} has {a} {i}. {n} buys {b} more and gives away {c}. How many {i} does {n} have now? Explain step by step.",
    "A box holds {a} {i}. How many {i} are in {b} boxes? Show your work.",
    "{n} shares {p} {i} equally among {k} friends. How many does each friend get? Reason step by step.",
    "A shirt costs {a} dollars and is on sale for {q} percent off. What is the sale price? Show the calculation.",
    "What is {q} percent of {p}? Explain how you get the answer.",
    "Solve {a}y + {b} = {r} for y, step by step.",
    "A car travels {a} kilometres in {k} hours. What is its average speed? Explain.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter? Show each step.",
    "{n} reads {b} pages a day. How many days does a {p}-page book take? Explain your reasoning.",
    "What is {a} times {b}? Work it out step by step.",
]


def math_prompts(count: int, rng: random.Random) -> list[str]:
    prompts = []
    for _ in range(count):
        a, b, k = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 9)
        values = {
            "n": rng.choice(NAMES),
            "i": rng.choice(ITEMS),
            "a": a,
            "b": b,
            "c": rng.randint(1, a),
            "k": k,
            "p": k * rng.randint(3, 40),
            "q": rng.choice([10, 15, 20, 25, 30, 40, 50]),
            "r": a * rng.randint(1, 9) + b,
        }
        prompts.append(rng.choice(MATH_TEMPLATES).format(**values))
    return prompts


def build_more_prompts(taken: set[str]) -> list[str]:
    prompts = [t.format(s=s) for s in SUBJECTS for t in MORE_SUBJECT_TEMPLATES]
    prompts += [t.format(t=c) for c in CODE_TASKS for t in MORE_CODE_TEMPLATES]
    prompts += [t.format(a=a) for a in ACTIVITIES for t in MORE_ACTIVITY_TEMPLATES]
    prompts += math_prompts(1200, random.Random(1))
    # never a bench prompt: `dflash bench demo` measures on prompts the drafter has not seen
    bench = {json.loads(line)["prompt"] for f in BENCH_DIR.glob("*.jsonl") for line in f.read_text().splitlines()}
    return sorted({" ".join(p.split()) for p in prompts} - taken - bench)


def python_paragraphs() -> list[str]:
    """Prose paragraphs (no grammar blocks or headings) of 200-700 characters from the Python reference."""
    paragraphs = []
    for text in pydoc_data.topics.topics.values():
        for block in re.split(r"\n\s*\n", text):
            line = " ".join(block.split())
            if 200 <= len(line) <= 700 and not block.startswith(" ") and "::=" not in line and "***" not in line:
                paragraphs.append(line)
    return paragraphs


def build_prompts() -> list[str]:
    subjects = SUBJECTS
    prompts = [t.format(s=s) for s in subjects for t in SUBJECT_TEMPLATES]
    prompts += [t.format(a=a) for a in ACTIVITIES for t in ACTIVITY_TEMPLATES]
    prompts += [t.format(t=c) for c in CODE_TASKS for t in CODE_TEMPLATES]
    prompts += [t.format(k=k.replace("-", " ")) for k in pydoc_data.topics.topics for t in PYTHON_TEMPLATES]
    prompts += [f"Summarize: {p}" for p in python_paragraphs()]
    prompts += [f"Compare {a} and {b}." for a, b in zip(subjects[::2], subjects[1::2])]
    prompts += CHAT
    return sorted({" ".join(p.split()) for p in prompts})


def write_prompt_files(out_dir: Path, held_out: int = 64) -> None:
    prompts = build_prompts()
    random.Random(0).shuffle(prompts)
    # The second batch goes after the first, so the held-out set and the first batch's order stay as they were.
    more = build_more_prompts(set(prompts))
    random.Random(2).shuffle(more)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, chunk in (
        ("demo_prompts_eval.jsonl", prompts[:held_out]),
        ("demo_prompts_train.jsonl", prompts[held_out:] + more),
    ):
        with open(out_dir / name, "w") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in chunk)
        print(f"{out_dir / name}: {len(chunk)} prompts")


def main(argv: list[str] | None = None) -> int:
    """`python scripts/make_demo_prompts.py [OUT_DIR]` (default dflash_cli/assets, relative to where it runs)."""
    argv = sys.argv[1:] if argv is None else argv
    write_prompt_files(Path(argv[0] if argv else "dflash_cli/assets"))
    return 0
