"""Write the demo drafter's prompt set: licence-clean prompts we build ourselves.

Sources: templates and word lists written here, and paragraphs of Python's own reference text
(`pydoc_data.topics`, PSF licence, shipped with every Python). Deterministic (seeded), so the
files in dflash_cli/assets/ can be rebuilt exactly (tests/loading/test_gguf.py checks it):

    python -m benchmarks.demo_prompts                              # dflash_cli/assets
    python -m benchmarks.demo_prompts runs/demo --everyday 30000   # the demo drafter's training set

No torch and no dflash_cli module here: the prompts are request lines for `dflash train`.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import random
import re
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "dflash_cli" / "assets"
BENCH_DIR = ASSETS / "bench_prompts"

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


# The third batch (issue 46): the kinds of requests users send a chat model, as clients send them: lists, how-tos,
# stories, letters, rewrites, code in several languages, arithmetic, JSON under a response_format, tool calls with
# the tools in the request, and a system prompt now and then. Combinatorial and seeded: tens of thousands of
# distinct requests from the lists below.
THINGS = [
    "fruits",
    "vegetables",
    "board games",
    "hobbies",
    "birds",
    "rivers",
    "musical instruments",
    "sports",
    "tools",
    "spices",
    "planets",
    "programming languages",
    "kitchen tools",
    "houseplants",
    "dog breeds",
    "flowers",
    "trees",
    "countries in Europe",
    "ocean animals",
    "desserts",
    "breakfast ideas",
    "careers",
    "colors",
    "cheeses",
    "famous scientists",
    "inventions",
    "holidays",
    "gifts for a friend",
    "snacks",
    "winter activities",
    "summer activities",
    "ways to save money",
    "healthy habits",
    "soups",
    "car parts",
    "insects",
    "gemstones",
]
NUMBERS = ["three", "four", "five", "six", "seven", "ten"]
PEOPLE = [
    "my manager",
    "a teacher",
    "my landlord",
    "a customer",
    "my neighbor",
    "a friend",
    "my team",
    "a new colleague",
    "my grandmother",
    "a hotel",
    "a shop",
    "the school",
    "a client",
    "my doctor's office",
]
OCCASIONS = [
    "asking for a day off",
    "thanking them for their help",
    "rescheduling a meeting",
    "complaining about a late order",
    "inviting them to a party",
    "apologizing for a mistake",
    "asking for a refund",
    "introducing myself",
    "following up on an interview",
    "declining an invitation",
    "asking a question about my bill",
]
CHARACTERS = [
    "a lonely robot",
    "a brave mouse",
    "a young wizard",
    "an old fisherman",
    "a curious cat",
    "a lost astronaut",
    "a kind dragon",
    "a shy giraffe",
    "a detective",
    "a little cloud",
    "a talking tree",
    "a pirate captain",
    "two best friends",
    "a baker",
    "a girl who could fly",
    "a grumpy penguin",
]
EVENTS = [
    "finds a secret door",
    "learns to share",
    "goes on a journey",
    "makes a new friend",
    "loses something important",
    "saves the day",
    "discovers a hidden talent",
    "gets lost in a city",
    "builds something amazing",
    "solves a mystery",
    "faces a big storm",
    "visits the moon",
]
STORY_TEMPLATES = [
    "Write a short story about {c} who {e}.",
    "Tell me a bedtime story about {c}.",
    "Write a story in five sentences about {c} who {e}.",
    "Write a funny story about {c}.",
    "Write a poem about {c} who {e}.",
    "Write the opening paragraph of a story about {c}.",
]
LIST_TEMPLATES = [
    "List {n} {t}.",
    "Name {n} {t}.",
    "Give me a list of {n} {t} with a short description of each.",
    "What are {n} popular {t}?",
    "Make a numbered list of {n} {t}.",
    "Suggest {n} {t} for a beginner.",
]
HOWTO_TEMPLATES = [
    "How do I get better at {a}?",
    "Give me a step-by-step guide to {a}.",
    "What are the first steps for {a}?",
    "I want to start {a}. Where do I begin?",
    "Write a checklist for {a}.",
    "What are common mistakes when {a}?",
]
LETTER_TEMPLATES = [
    "Write an email to {p} {o}.",
    "Write a short message to {p} {o}.",
    "Draft a polite letter to {p} {o}.",
    "Help me write a text to {p} {o}.",
]
SENTENCES = [
    "the meeting was moved to friday because the room was not free",
    "i think we should try the new restaurant next week",
    "our team finished the project two days early",
    "the weather was bad so the game got cancelled",
    "she forgot her keys at home and had to wait outside",
    "we are happy to announce that the store opens on monday",
    "he dont like coffee but he drink tea every morning",
    "the report have many mistake and need more work",
    "please send me the files when you have time",
    "the train was late again and everyone was annoyed",
]
REWRITE_TEMPLATES = [
    'Rewrite this sentence to sound more formal: "{x}"',
    'Fix the grammar and spelling: "{x}"',
    'Make this sound friendlier: "{x}"',
    'Translate into French: "{x}"',
    'Translate into Spanish: "{x}"',
    'Summarize in a few words: "{x}"',
    'Turn this into a question: "{x}"',
]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "Bash", "SQL", "C++"]
CODE_LANGUAGE_TEMPLATES = [
    "Write a {l} function that {t}.",
    "Show me how to write code in {l} that {t}.",
    "In {l}, write a program that {t}. Keep it short.",
    "Explain how to write a {l} function that {t}, then show the code.",
]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Answer briefly.",
    "You are a patient teacher who explains things simply.",
    "You are a concise assistant. Use short sentences.",
    "You are an expert programmer. Answer with code when it helps.",
]
JSON_TEMPLATES = [
    "Give me {n} {t} as JSON, each with a name and a short description.",
    "Return a JSON object describing {s} with the keys name, summary and facts.",
    "List {n} {t} in JSON.",
    "Describe {s} as a JSON object.",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
EXTRACT_TEMPLATES = [
    "Extract the name, age and city: {n} is {a} years old and lives in {c}.",
    "{n}, aged {a}, moved to {c} last year. Give me the person's details.",
    "Read this and fill in the fields: my name is {n}, I am {a} and I live in {c}.",
]
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Toronto", "Madrid", "Nairobi", "Sydney", "Seoul"]
TOOLS = {
    "get_weather": ("Get the current weather for a city.", {"city": {"type": "string", "description": "City name"}}),
    "search_web": ("Search the web and return the top results.", {"query": {"type": "string"}}),
    "calculate": ("Evaluate an arithmetic expression.", {"expression": {"type": "string"}}),
    "send_email": (
        "Send an email.",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
    ),
    "get_time": ("Get the current time in a time zone.", {"timezone": {"type": "string"}}),
    "convert_currency": (
        "Convert an amount between currencies.",
        {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
    ),
}
TOOL_PROMPTS = {
    "get_weather": ["What's the weather like in {c}?", "Is it raining in {c} right now?", "Do I need a coat in {c}?"],
    "search_web": ["Search for the best way to learn {t}.", "Find recent news about {s}.", "Look up facts about {s}."],
    "calculate": ["What is {a} times {b}?", "Calculate {a} plus {b} divided by 2.", "What is {a} squared?"],
    "send_email": ["Send an email to {p} about {o}.", "Email {p} and tell them I'm running late."],
    "get_time": ["What time is it in {c}?", "Tell me the current time in {c}."],
    "convert_currency": ["Convert {a} dollars to euros.", "How much is {a} euros in yen?"],
}


def tool(name: str) -> dict:
    description, properties = TOOLS[name]
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def everyday_requests(count: int, seed: int, taken: set[str]) -> list[dict]:
    """`count` distinct request lines of the kinds above, in even shares as far as each kind's lists go (a kind
    of few distinct prompts gives all it has): a `prompt`, or `messages` with a system prompt; tools or a
    response_format where the kind asks for them. No prompt text in `taken`."""
    rng = random.Random(seed)
    tools = [
        (template.format(a=a, b=b, c=c, p=p, o=o, t=t, s=s), name)
        for name, templates in TOOL_PROMPTS.items()
        for template in templates
        for a, b, c, p, o, t, s in zip(
            rng.choices(range(2, 500), k=60), rng.choices(range(2, 99), k=60), rng.choices(CITIES, k=60),
            rng.choices(PEOPLE, k=60), rng.choices(OCCASIONS, k=60), rng.choices(THINGS, k=60),
            rng.choices(SUBJECTS, k=60),
        )
    ]  # fmt: skip
    people = [(rng.choice(NAMES), rng.randint(18, 90), rng.choice(CITIES)) for _ in range(600)]
    json_object = {"response_format": {"type": "json_object"}}
    person = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}}
    kinds: list[list[tuple[str, dict]]] = [
        [(t.format(n=n, t=x), {}) for t in LIST_TEMPLATES for n in NUMBERS for x in THINGS],
        [(t.format(a=a), {}) for t in HOWTO_TEMPLATES for a in ACTIVITIES],
        [(t.format(c=c, e=e), {}) for t in STORY_TEMPLATES for c in CHARACTERS for e in EVENTS],
        [(t.format(p=p, o=o), {}) for t in LETTER_TEMPLATES for p in PEOPLE for o in OCCASIONS],
        [(t.format(x=x), {}) for t in REWRITE_TEMPLATES for x in SENTENCES],
        [(t.format(l=lang, t=task), {}) for t in CODE_LANGUAGE_TEMPLATES for lang in LANGUAGES for task in CODE_TASKS],
        [(p, {}) for p in math_prompts(3000, rng)],
        [(t.format(n=n, t=x, s=s), json_object) for t in JSON_TEMPLATES for n in NUMBERS for x in THINGS
         for s in rng.sample(SUBJECTS, 3)],
        [(t.format(n=n, a=a, c=c), person) for t in EXTRACT_TEMPLATES for n, a, c in people],
        [(text, {"tools": [tool(n) for n in sorted({name, *rng.sample(sorted(TOOLS), rng.randint(0, 2))})]})
         for text, name in tools],
        [(t.format(s=s), {}) for t in SUBJECT_TEMPLATES + MORE_SUBJECT_TEMPLATES for s in SUBJECTS],
    ]  # fmt: skip
    pools = []
    for pool in kinds:
        unique = {" ".join(text.split()): extra for text, extra in pool}
        pools.append([(text, unique[text]) for text in sorted(set(unique) - taken)])
        rng.shuffle(pools[-1])
    lines: list[dict] = []
    while len(lines) < count and any(pools):
        for pool in pools:
            if pool and len(lines) < count:
                prompt, extra = pool.pop()
                lines.append(request_line(prompt, extra, rng))
    return lines


def request_line(prompt: str, extra: dict, rng: random.Random) -> dict:
    """A request line: a `prompt`, or `messages` with a system prompt a quarter of the time (drawn from `rng`) or
    where the request has tools (they come with a conversation); `extra` (tools, response_format) added."""
    turns = [{"role": "user", "content": prompt}]
    if rng.random() < 0.25:
        turns.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if len(turns) > 1 or "tools" in extra:
        return {"messages": turns, **extra}
    return {"prompt": prompt, **extra}


# The fourth batch (issue 46): open-ended prose on many more subjects. The drafter learned the template-made kinds
# (arithmetic, JSON, tool calls: walked tau 2.3-2.8) and not prose (1.58 on explanations among its own training
# answers), and users mostly ask for prose; the first three batches hold about 2,000 prose requests on 103 subjects.
PROSE_SUBJECTS = [
    # nature and science
    "tides", "coral reefs", "wetlands", "tornadoes", "hurricanes", "lightning", "fog", "clouds", "seasons",
    "the ozone layer", "fossils", "dinosaurs", "evolution", "DNA", "cells", "bacteria", "viruses",
    "antibiotics", "the brain", "memory", "dreams", "the lungs", "bones", "muscles", "the skin", "eyesight",
    "hearing", "taste", "allergies", "the common cold", "fever", "nutrition", "protein", "sugar", "salt",
    "fiber", "caffeine", "atoms", "molecules", "chemical reactions", "acids and bases", "rust", "fire",
    "light", "sound", "heat", "friction", "magnets", "lasers", "radio waves", "microwaves", "x-rays",
    "nuclear power", "hydropower", "geothermal energy", "fossil fuels", "plastic", "glass", "steel", "paper",
    "soil", "compost", "seeds", "trees", "mushrooms", "moss", "cactuses", "sunflowers", "wolves", "foxes",
    "bears", "whales", "sharks", "octopuses", "jellyfish", "turtles", "frogs", "snakes", "butterflies",
    "ants", "spiders", "eagles", "parrots", "crows", "migration", "hibernation", "food chains", "ecosystems",
    "biodiversity", "pollination", "the Milky Way", "comets", "asteroids", "eclipses", "the sun", "Jupiter",
    "Saturn's rings", "space stations", "astronauts", "telescopes", "time zones", "calendars", "leap years",
    # people, places and history
    "the Great Wall of China", "the pyramids", "the Vikings", "the Renaissance", "the Industrial Revolution",
    "the Silk Road", "ancient Greece", "the Middle Ages", "castles", "knights", "samurai", "explorers",
    "the first cars", "the telephone", "the light bulb", "the radio", "television", "newspapers", "the post",
    "money", "banks", "taxes", "inflation", "interest rates", "credit cards", "insurance", "trade", "markets",
    "cities", "villages", "islands", "bridges", "tunnels", "skyscrapers", "highways", "ports", "airports",
    "democracy", "elections", "laws", "courts", "human rights", "the United Nations", "voting", "citizenship",
    # everyday life
    "breakfast", "lunch at work", "family dinners", "fast food", "vegetarian food", "spices", "soup", "rice",
    "pizza", "salads", "fruit", "vegetables", "tea ceremonies", "birthdays", "weddings", "holidays", "gifts",
    "neighbors", "roommates", "pets", "houseplants", "cleaning", "laundry", "moving house", "commuting",
    "public transport", "road safety", "first aid", "fire safety", "online safety", "privacy", "social media",
    "video games", "board games", "puzzles", "movies", "theater", "dancing", "singing", "drawing", "knitting",
    "woodworking", "fishing", "birdwatching", "running", "yoga", "cycling", "tennis", "basketball",
    "volunteering", "teamwork", "leadership", "motivation", "habits", "procrastination", "patience",
    "honesty", "gratitude", "curiosity", "creativity", "confidence", "failure", "success", "happiness",
    "loneliness", "stress", "anger", "empathy", "listening", "apologizing", "negotiation", "feedback",
    # school and work
    "homework", "exams", "note-taking", "school uniforms", "online classes", "teachers", "universities",
    "scholarships", "internships", "job interviews", "remote work", "meetings", "deadlines", "emails at work",
    "small businesses", "customer service", "marketing", "advertising", "startups", "resumes", "careers",
    "nursing", "engineering", "farming", "architecture", "journalism", "law", "medicine", "programming",
    "open source software", "cloud computing", "cybersecurity", "web browsers", "search engines", "apps",
    "video calls", "3D printing", "virtual reality", "self-driving cars", "drones", "smart homes", "GPS",
]  # fmt: skip
WORKINGS = [  # the subjects "How does ... work?" asks about: things with a mechanism
    "the brain", "memory", "the lungs", "eyesight", "hearing", "lasers", "radio waves", "microwaves", "x-rays",
    "nuclear power", "hydropower", "geothermal energy", "the telephone", "the light bulb", "the radio", "television",
    "banks", "taxes", "inflation", "interest rates", "credit cards", "insurance", "elections", "voting", "the post",
    "public transport", "web browsers", "search engines", "cloud computing", "GPS", "drones", "3D printing",
    "virtual reality", "self-driving cars", "smart homes", "video calls", "telescopes", "compost", "pollination",
    "migration", "hibernation", "tides", "eclipses", "rust", "fire", "friction", "magnets", "the sun",
]  # fmt: skip
NEW_PROSE_TEMPLATES = [  # (with SUBJECT_TEMPLATES and MORE_SUBJECT_TEMPLATES, on PROSE_SUBJECTS)
    "Give me an overview of {s}.",
    "Explain the basics of {s}.",
    "I'm curious about {s}. What should I know?",
    "Can you explain {s} briefly?",
    "What are some common myths about {s}?",
    "Write a paragraph for a school report on {s}.",
    "How has {s} changed over time?",
    "What would the world be like without {s}?",
    "Write a short speech about {s}.",
    "Write the opening of a blog post about {s}.",
    "Summarize what you know about {s} in three sentences.",
    "Write a short story that involves {s}.",
    "What questions do kids often ask about {s}? Answer two of them.",
    "Compare {s} with something from everyday life.",
]
NEW_ADVICE_TEMPLATES = [  # (with ACTIVITY_TEMPLATES and MORE_ACTIVITY_TEMPLATES, on EVERYDAY_ACTIVITIES)
    "What should I keep in mind when {a}?",
    "I'm nervous about {a}. Any advice?",
    "How do I get started with {a}?",
]
TRIP_TEMPLATES = ["Help me get ready for {t}.", "Can you help me plan {t}?", "Give me some tips for {t}."]
TRIPS = [
    "a beach holiday", "a camping trip", "a business trip", "a city break", "a long flight", "a road trip",
    "a school trip", "a picnic", "a ski trip", "a visit to my grandparents", "a music festival", "a day at the zoo",
    "a winter vacation",
]  # fmt: skip
EVERYDAY_ACTIVITIES = [
    "learning to swim", "starting a new job", "moving to a new city", "cooking for friends", "buying a used car",
    "adopting a cat", "starting a vegetable garden", "training for a 5k run", "writing a novel", "learning to draw",
    "making a budget", "paying off debt", "asking for a raise", "going back to school", "learning to drive",
    "planning a wedding", "hosting a dinner party", "teaching a child to read", "keeping a journal",
    "waking up early", "eating healthier", "cutting down on sugar", "taking a gap year", "studying abroad",
    "building a website", "starting a podcast", "selling old things online", "decluttering my home",
    "painting a room", "caring for an elderly parent",
]  # fmt: skip
SINGULAR_IN_S = {"glass", "success", "stress", "happiness", "loneliness", "the United Nations", "GPS", "tennis"}
PLURAL_NOT_IN_S = {"bacteria", "samurai"}


def agreeing(template: str, subject: str) -> str:
    """`template` filled with `subject`, its verb agreeing in number ("What are fossils?", "How does GPS work?")."""
    if (subject.endswith("s") and subject not in SINGULAR_IN_S) or subject in PLURAL_NOT_IN_S:
        for singular, plural in (("is {s}", "are {s}"), ("does {s}", "do {s}"), ("has {s}", "have {s}")):
            template = template.replace(singular, plural)
    return template.format(s=subject)


def prose_requests(count: int, seed: int, taken: set[str]) -> list[dict]:
    """Up to `count` distinct open-ended prose requests (the subject templates on PROSE_SUBJECTS, "How does ...
    work?" on WORKINGS, advice on everyday activities and trips), none in `taken`, lines as everyday_requests'."""
    rng = random.Random(seed)
    about = SUBJECT_TEMPLATES + MORE_SUBJECT_TEMPLATES + NEW_PROSE_TEMPLATES
    pool = [agreeing(t, s) for t in about for s in PROSE_SUBJECTS]
    pool += [agreeing("How does {s} work?", s) for s in WORKINGS]
    pool += [t.format(a=a) for t in ACTIVITY_TEMPLATES + MORE_ACTIVITY_TEMPLATES for a in EVERYDAY_ACTIVITIES]
    pool += [t.format(a=a) for t in NEW_ADVICE_TEMPLATES for a in ACTIVITIES + EVERYDAY_ACTIVITIES]
    pool += [t.format(t=trip) for t in TRIP_TEMPLATES for trip in TRIPS]
    pool = sorted({" ".join(text.split()) for text in pool} - taken)
    rng.shuffle(pool)
    return [request_line(prompt, {}, rng) for prompt in pool[:count]]


def write_prompt_files(out_dir: Path, held_out: int = 64, everyday: int = 0, prose: int = 0) -> None:
    """The held-out and the training prompts; `everyday` more training requests of everyday_requests' kinds after
    the first two batches, then `prose` of prose_requests' (so that the files' first lines stay as they were)."""
    prompts = build_prompts()
    random.Random(0).shuffle(prompts)
    # The second batch goes after the first, so the held-out set and the first batch's order stay as they were.
    more = build_more_prompts(set(prompts))
    random.Random(2).shuffle(more)
    bench = {json.loads(line)["prompt"] for f in BENCH_DIR.glob("*.jsonl") for line in f.read_text().splitlines()}
    third = everyday_requests(everyday, 3, set(prompts) | set(more) | bench)
    said = {line.get("prompt") or line["messages"][-1]["content"] for line in third}
    fourth = prose_requests(prose, 4, set(prompts) | set(more) | bench | said)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, lines in (
        ("demo_prompts_eval.jsonl", [{"prompt": p} for p in prompts[:held_out]]),
        ("demo_prompts_train.jsonl", [{"prompt": p} for p in prompts[held_out:] + more] + third + fourth),
    ):
        with open(out_dir / name, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        print(f"{out_dir / name}: {len(lines)} prompts")


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.demo_prompts [OUT_DIR] [--everyday N] [--prose N]` (default dflash_cli/assets and 0,
    the shipped files; the demo drafter's training adds --everyday 30000 --prose 8000 in its own folder)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_prompts", description=main.__doc__)
    parser.add_argument("out_dir", nargs="?", default=str(ASSETS), type=Path)
    parser.add_argument("--everyday", type=int, default=0, metavar="N")
    parser.add_argument("--prose", type=int, default=0, metavar="N")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    write_prompt_files(args.out_dir, everyday=args.everyday, prose=args.prose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
