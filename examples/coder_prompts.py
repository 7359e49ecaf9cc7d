"""Training prompts for a coding assistant's EAGLE head, built from this Python's standard library.

What a coder model is asked, in five kinds (each prompt is tagged with its kind):

- "implement": write a function from its name, arguments and docstring summary (chat);
- "complete": raw completion of a standard-library function from the lines above its body (no chat template);
- "edit": a function's source and a change to make (add type hints, rename, refactor, ...) (chat);
- "tests": unit tests for a function's source (chat);
- "chat": questions about library functions and programming topics, and everyday questions (chat).

Everything is deterministic for a given seed and standard library. The benchmark's
prompts (`held_out_prompts.json`) are left out, and so is the module they use (csv).

Example:
  >>> prompts = coder_prompts(lambda text: text, seed=0, max_functions=20)  # doctest: +SKIP
  >>> sorted({kind for kind, _ in prompts})  # doctest: +SKIP
  ['chat', 'complete', 'edit', 'implement', 'tests']
"""

from __future__ import annotations

import ast
import functools
import glob
import json
import os
import sysconfig
from collections.abc import Callable

import numpy as np

KINDS = ("implement", "complete", "edit", "tests", "chat")

IMPLEMENT = [
  "Write a Python function `{sig}` that does this: {summary}",
  "Implement `{sig}` in Python. It should: {summary}",
  "Write `{sig}` in Python ({summary}). Include a docstring.",
  "I need a Python function `{sig}`. {summary} Answer with the code only.",
]
EDIT = [
  "Add type hints to this function and return the whole function:",
  "Refactor this function to make it easier to read, keeping its behaviour:",
  "Add a docstring and comments to this function:",
  "Rename the function to `{new}` and return the whole code:",
  "Rewrite this function so that it has no nested blocks deeper than two levels:",
  "Find possible bugs in this function and return a fixed version:",
  "Convert this function into a method of a small class and show how to call it:",
  "Make this function raise a ValueError with a clear message on invalid input:",
]
TESTS = [
  "Write pytest unit tests for this function:",
  "Write unittest test cases for this function, including edge cases:",
]
EXPLAIN = [
  "Explain what this code does, step by step:",
  "What is the time complexity of this function? Explain.",
]
LIBRARY_QUESTIONS = [
  "In Python's `{module}` module, what does `{name}` do? Give an example.",
  "How can I use `{module}.{name}` in my own code?",
  'What does this mean in Python\'s documentation: "{summary}"?',
]
PROGRAMMING_TOPICS = [
  "list comprehensions",
  "generators",
  "decorators",
  "context managers",
  "async and await",
  "type hints",
  "dataclasses",
  "exceptions",
  "unit testing",
  "virtual environments",
  "regular expressions",
  "recursion",
  "binary search",
  "hash tables",
  "linked lists",
  "sorting algorithms",
  "dynamic programming",
  "graph traversal",
  "big-O notation",
  "SQL joins",
  "database indexes",
  "REST APIs",
  "HTTP status codes",
  "JSON parsing",
  "git rebase",
  "git merge conflicts",
  "Docker containers",
  "shell pipelines",
  "multithreading",
  "multiprocessing",
  "memory leaks",
  "object-oriented design",
  "inheritance versus composition",
  "immutability",
  "functional programming",
  "logging",
  "command-line arguments",
  "file I/O",
  "string formatting",
  "floating-point precision",
  "bit manipulation",
  "caching",
  "rate limiting",
  "code review",
  "refactoring",
  "JavaScript promises",
  "TypeScript interfaces",
  "Rust ownership",
  "Go goroutines",
  "C pointers",
  "Java generics",
  "React components",
  "CSS flexbox",
  "pandas DataFrames",
  "NumPy broadcasting",
  "matrix multiplication",
  "gradient descent",
  "tokenization",
  "unicode",
  "time zones",
]
PROGRAMMING_TEMPLATES = [
  "Explain {t} with a short code example.",
  "What are common mistakes with {t}?",
  "When should I use {t}? Give an example.",
  "Write a small program that demonstrates {t}.",
  "Compare two ways of doing {t} and say which you prefer.",
  "What is {t}? Answer for a beginner.",
]
EVERYDAY_TOPICS = [
  "photosynthesis",
  "black holes",
  "the French Revolution",
  "climate change",
  "the immune system",
  "volcanoes",
  "coffee",
  "honeybees",
  "electric cars",
  "the Roman Empire",
  "sleep",
  "chess",
  "gravity",
  "vaccines",
  "recycling",
  "dinosaurs",
  "solar panels",
  "the printing press",
  "rainbows",
  "public speaking",
  "time management",
  "gardening",
  "bread baking",
  "the human heart",
  "earthquakes",
  "friendship",
  "penguins",
  "hurricanes",
  "budgeting",
  "job interviews",
  "camping",
  "the ocean tides",
  "the Olympic Games",
  "the history of jazz",
  "birdwatching",
  "wind turbines",
]
EVERYDAY_TEMPLATES = [
  "Explain {t} in simple terms.",
  "What are three interesting facts about {t}?",
  "Write a short paragraph about {t}.",
  "Give me some tips related to {t}.",
  "How would you explain {t} to a ten-year-old?",
]
SKIP_MODULES = ("csv.py",)  # the benchmark asks how to read a CSV file

# General-knowledge questions (train_eagle's --more-questions): comparisons, how things work, why things happen,
# ideas. The shipped head agreed with the target only half the time on such prose. The benchmark's own topics
# (pets, bicycles, cells, autumn leaves, laws, thank-you notes, rainy weekends) are left out altogether.
COMPARISONS = [
  ("tea", "coffee"),
  ("trains", "planes"),
  ("renting", "buying a home"),
  ("e-books", "paper books"),
  ("running", "swimming"),
  ("cities", "the countryside"),
  ("summer", "winter"),
  ("rivers", "lakes"),
  ("viruses", "bacteria"),
  ("weather", "climate"),
  ("frogs", "toads"),
  ("crocodiles", "alligators"),
  ("butter", "margarine"),
  ("a violin", "a viola"),
  ("baking", "roasting"),
  ("stocks", "bonds"),
  ("the Arctic", "the Antarctic"),
  ("moths", "butterflies"),
  ("hurricanes", "tornadoes"),
  ("wolves", "foxes"),
  ("a debit card", "a credit card"),
  ("jam", "jelly"),
  ("Mars", "Venus"),
  ("comets", "asteroids"),
  ("a democracy", "a monarchy"),
  ("walking", "cycling to work"),
  ("radio", "podcasts"),
  ("oil paint", "watercolour"),
  ("a lake", "a sea"),
  ("sheep", "goats"),
  ("rice", "pasta"),
  ("a novel", "a short story"),
]
COMPARISON_TEMPLATES = [
  "What are the main differences between {a} and {b}?",
  "Compare {a} and {b}. Which would you choose, and why?",
  "What do {a} and {b} have in common, and how do they differ?",
]
HOW_THINGS = [
  "a refrigerator",
  "a microwave oven",
  "a rainbow",
  "an airplane wing",
  "a compass",
  "a lock and key",
  "a thermostat",
  "the internet",
  "a hot air balloon",
  "a camera",
  "a submarine",
  "a vaccine",
  "a solar panel",
  "an elevator",
  "a piano",
  "GPS navigation",
  "a lighthouse",
  "a touch screen",
  "a sailboat against the wind",
  "a battery",
  "a washing machine",
  "a parachute",
  "a dam",
  "a telescope",
  "a heat pump",
  "the human eye",
  "a credit score",
  "an election count",
  "a water filter",
  "a kite",
  "a sewing machine",
  "noise-cancelling headphones",
  "a wind-up watch",
  "an escalator",
  "a fridge magnet",
]
HOW_TEMPLATES = [
  "Explain how {t} works.",
  "How does {t} work? Keep it short.",
  "Describe, step by step, how {t} works.",
]
WHY_QUESTIONS = [
  "Why is the sky blue?",
  "Why do we have seasons?",
  "Why does bread go stale?",
  "Why do owls hunt at night?",
  "Why is the sea salty?",
  "Why do onions make you cry?",
  "Why do we dream?",
  "Why do birds migrate?",
  "Why does ice float?",
  "Why do stars twinkle?",
  "Why do we yawn?",
  "Why do some people get seasick?",
  "Why is exercise good for the brain?",
  "Why do prices rise over time?",
  "Why do zebras have stripes?",
  "Why does the moon change shape?",
  "Why do we need sleep?",
  "Why do planes leave white trails?",
  "Why is it colder on a mountain top?",
  "Why do some metals rust?",
  "Why do we get goosebumps?",
  "Why do apples turn brown when cut?",
  "Why does music give people chills?",
  "Why do whales sing?",
  "Why do languages change over time?",
  "Why is the Dead Sea so easy to float in?",
]
IDEA_TOPICS = [
  "a birthday party for a five-year-old",
  "a picnic menu",
  "learning a new language",
  "saving money on groceries",
  "a science fair project",
  "staying focused while studying",
  "a small balcony garden",
  "a first date",
  "decorating a tiny flat",
  "keeping fit without a gym",
  "a family road trip",
  "making new friends in a new city",
  "a book club's next meeting",
  "reducing plastic at home",
  "a school fundraiser",
  "a relaxing evening routine",
]
IDEA_TEMPLATES = [
  "Give me three ideas for {t}.",
  "What are five good ideas for {t}?",
  "I need some suggestions for {t}. What would you recommend?",
]


# Topics the target writes its own questions about (train_eagle's --self-questions): general knowledge beyond the
# lists above, so the questions' wording and subjects are the model's, not a template's.
SELF_QUESTION_TOPICS = [
  "how bridges carry heavy loads",
  "why ships float",
  "how a gyroscope keeps its balance",
  "skateboards and how riders balance",
  "horses and horse riding",
  "keeping rabbits",
  "parrots as companions",
  "goldfish and aquariums",
  "hamsters",
  "elephants",
  "octopus intelligence",
  "ant colonies",
  "bird nests",
  "how bats find their way",
  "hibernation",
  "spiders and their webs",
  "the life of a tree",
  "how seeds spread",
  "cactus plants",
  "houseplants",
  "bamboo",
  "the northern lights",
  "lightning and thunder",
  "snowflakes",
  "fog",
  "tsunamis",
  "the layers of the Earth",
  "fossils",
  "caves",
  "the Amazon river",
  "mountain formation",
  "sand dunes",
  "the speed of light",
  "sound waves",
  "magnets",
  "friction",
  "levers and pulleys",
  "the wheel",
  "steam engines",
  "clocks and timekeeping",
  "the telephone",
  "television",
  "radio waves",
  "bar codes",
  "credit card security",
  "how a car engine works",
  "electric motors",
  "traffic lights",
  "roundabouts",
  "motorbikes",
  "sailing",
  "rowing",
  "ice skating",
  "skiing",
  "football tactics",
  "basketball",
  "tennis",
  "cricket",
  "the history of the Olympics",
  "mountain climbing",
  "hiking safety",
  "learning to cook",
  "fermented food",
  "chocolate",
  "spices",
  "cheese making",
  "vegetarian diets",
  "drinking enough water",
  "vitamins",
  "the common cold",
  "allergies",
  "the human skeleton",
  "muscles",
  "the sense of smell",
  "memory",
  "habits",
  "motivation",
  "procrastination",
  "stress",
  "kindness",
  "writing a letter of apology",
  "writing a birthday card",
  "giving feedback to a colleague",
  "planning a wedding",
  "moving house",
  "choosing a university",
  "starting a small business",
  "taxes",
  "interest rates",
  "insurance",
  "the history of money",
  "the Vikings",
  "ancient Greece",
  "the Middle Ages",
  "castles",
  "the pyramids",
  "the Cold War",
  "the space race",
  "the International Space Station",
  "Jupiter",
  "Saturn's rings",
  "exoplanets",
  "telescopes",
  "maps and map projections",
  "time zones",
  "calendars",
  "languages of the world",
  "sign language",
  "poetry",
  "painting styles",
  "classical music",
  "learning the guitar",
  "singing",
  "theatre",
  "museums",
  "architecture",
  "skyscrapers",
  "tiny houses",
  "furniture design",
  "fashion history",
  "sustainable fashion",
  "electric bikes",
  "public transport",
  "high-speed trains",
  "electric aircraft",
  "nuclear power",
  "hydropower",
  "geothermal energy",
  "plastic in the oceans",
  "endangered species",
  "national parks",
  "beekeeping",
  "farming",
  "irrigation",
  "weather forecasts",
  "artificial intelligence in everyday life",
  "smartphones",
  "social media",
  "online privacy",
  "video games",
  "robots",
  "self-driving cars",
  "drones",
  "virtual reality",
]

# Words of the benchmark's own topics (examples/held_out_prompts.json): a self-written question with one of them is
# dropped, so the head is not trained on the benchmark's subjects in the model's own words either.
BENCHMARK_WORDS = (
  "cat",
  "cats",
  "kitten",
  "dog",
  "dogs",
  "puppy",
  "pet",
  "pets",
  "bicycle",
  "bicycles",
  "bike",
  "bikes",
  "cycling",
  "cyclist",
  "thank-you",
  "thank",
  "teacher",
  "csv",
  "mitochondria",
  "mitochondrion",
  "cell",
  "cells",
  "rainy",
  "weekend",
  "leaves",
  "leaf",
  "autumn",
  "bill",
  "law",
  "laws",
  "palindrome",
  "lru",
)


def about_the_benchmark(text: str) -> bool:
  """Whether `text` names one of the benchmark's subjects (a word of BENCHMARK_WORDS, any case).

  Example:
    >>> about_the_benchmark("Why do Dogs bark?"), about_the_benchmark("Why do catapults work?")
    (True, False)
  """
  words = set("".join(c if c.isalnum() or c == "-" else " " for c in text.lower()).split())
  return not words.isdisjoint(BENCHMARK_WORDS)


def self_question_topics() -> list[str]:
  """The topics of --self-questions: SELF_QUESTION_TOPICS, then the everyday topics, the things whose workings
  the general questions ask about, the idea topics and the compared pairs, in a fixed order, none of them about
  the benchmark's subjects."""
  topics = SELF_QUESTION_TOPICS + EVERYDAY_TOPICS + HOW_THINGS + IDEA_TOPICS + [f"{a} and {b}" for a, b in COMPARISONS]
  return [t for t in dict.fromkeys(topics) if not about_the_benchmark(t)]


def general_questions(chat: Callable[[str], str]) -> list[tuple[str, str]]:
  """("question", prompt text) pairs of general-knowledge questions (the lists above), in a fixed order, without the
  benchmark's prompts. train_eagle's --more-questions appends them after `coder_prompts`' list, so data made
  without them is a prefix of data made with them (and extends)."""
  texts = [tpl.format(a=a, b=b) for a, b in COMPARISONS for tpl in COMPARISON_TEMPLATES]
  texts += [tpl.format(t=t) for t in HOW_THINGS for tpl in HOW_TEMPLATES]
  texts += WHY_QUESTIONS
  texts += [tpl.format(t=t) for t in IDEA_TOPICS for tpl in IDEA_TEMPLATES]
  held = held_out_texts()
  return [("question", chat(t)) for t in texts if t not in held]


def _stdlib_files() -> list[str]:
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
  skip = (os.sep + "test", "site-packages", "idlelib", "lib2to3", "turtledemo")
  return [f for f in files if not any(s in f[len(root) :] for s in skip) and os.path.basename(f) not in SKIP_MODULES]


@functools.cache
def stdlib_functions(max_lines: int = 40) -> tuple[dict, ...]:
  """Public functions of the standard library with a docstring: module, name, signature, summary, source, context.

  Parsed once per process (about 3 s); treat the dicts as read-only.
  """
  root = sysconfig.get_paths()["stdlib"]
  found = []
  for path in _stdlib_files():
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
      tree = ast.parse(text)
    except (SyntaxError, ValueError, UnicodeDecodeError):
      continue
    lines = text.splitlines()
    module = os.path.splitext(os.path.relpath(path, root))[0].replace(os.sep, ".")
    for node in ast.walk(tree):
      if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        continue
      doc = ast.get_docstring(node)
      summary = doc.strip().split("\n")[0].strip() if doc else ""
      if not 20 <= len(summary) <= 200:
        continue
      args = [a.arg for a in node.args.args]
      n_lines = node.end_lineno - node.lineno + 1
      source = "\n".join(lines[node.lineno - 1 : node.end_lineno]) if n_lines <= max_lines else ""
      body = node.body[1] if len(node.body) > 1 else None  # the first statement after the docstring
      head_end = (body.lineno - 1) if body is not None else node.end_lineno
      found.append(
        {
          "module": module,
          "name": node.name,
          "sig": f"{node.name}({', '.join(args)})",
          "summary": summary,
          "source": _dedent(source),
          "context": "\n".join(lines[max(0, node.lineno - 12) : head_end]) + "\n",
        }
      )
  return tuple(found)


def _dedent(source: str) -> str:
  lines = source.splitlines()
  indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0)
  return "\n".join(x[indent:] for x in lines)


def held_out_texts() -> set[str]:
  """The benchmark's prompts (examples/held_out_prompts.json), never trained on."""
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "held_out_prompts.json")) as f:
    data = json.load(f)
  return {p for key in ("questions", "code_tasks", "edit_tasks") for p in data[key]}


def coder_prompts(chat: Callable[[str], str], *, seed: int, max_functions: int = 0) -> list[tuple[str, str]]:
  """(kind, prompt text) pairs, shuffled; `chat(text)` wraps a user message in the model's chat template.

  Each function of the standard library gives one "implement" prompt and, with a
  short enough body, a "complete", an "edit", and (every other one) a "tests" or
  an "explain" prompt; library questions, programming topics and everyday topics
  add the chat prompts.

  Args:
    chat: the chat template (e.g. `qwen2_5_coder.chat_prompt`).
    seed: the shuffle and the template choices.
    max_functions: use only this many functions (0 = all), for quick runs.
  """
  rng = np.random.default_rng(seed)
  functions = stdlib_functions()
  order = rng.permutation(len(functions))
  functions = [functions[i] for i in (order[:max_functions] if max_functions else order)]
  out: list[tuple[str, str]] = []

  def pick(options):
    return options[int(rng.integers(len(options)))]

  for i, fn in enumerate(functions):
    out.append(("implement", chat(pick(IMPLEMENT).format(**fn))))
    out.append(("chat", chat(pick(LIBRARY_QUESTIONS).format(**fn))))
    if not fn["source"]:
      continue
    out.append(("complete", fn["context"]))
    code = f"```python\n{fn['source']}\n```"
    out.append(("edit", chat(pick(EDIT).format(new=f"{fn['name']}_v2") + "\n\n" + code)))
    if i % 2 == 0:
      out.append(("tests", chat(pick(TESTS) + "\n\n" + code)))
    else:
      out.append(("chat", chat(pick(EXPLAIN) + "\n\n" + code)))
  for t in PROGRAMMING_TOPICS:
    out += [("chat", chat(tpl.format(t=t))) for tpl in PROGRAMMING_TEMPLATES]
  for t in EVERYDAY_TOPICS:
    out += [("chat", chat(tpl.format(t=t))) for tpl in EVERYDAY_TEMPLATES]
  held = {chat(t) for t in held_out_texts()}
  out = [(k, p) for k, p in out if p not in held]
  return [out[i] for i in rng.permutation(len(out))]
