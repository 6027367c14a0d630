"""Write src/spec_train/prompts.jsonl: instruction prompts for draft self-distillation.

Templates x subjects written for this project (no download). Deterministic: re-running rewrites the
same file. Every 10th prompt is held out by the trainer (`--held-out-every 10`), so the held-out set
mixes all kinds.
"""

import json
import random
from pathlib import Path

CODE = ["checks whether a number is prime", "reverses a string", "returns the n-th Fibonacci number",
        "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list while keeping order",
        "computes the factorial of a number", "checks whether a string is a palindrome", "flattens a nested list",
        "finds the largest element in a list", "converts Celsius to Fahrenheit", "computes the greatest common divisor of two numbers",
        "sorts a list of dictionaries by a key", "reads a text file and counts its words", "returns the second largest number in a list",
        "checks whether two strings are anagrams", "computes the average of a list of numbers", "splits a list into chunks of size n",
        "converts a binary string to an integer", "finds all even numbers in a list", "capitalizes the first letter of every word",
        "computes the sum of the digits of an integer", "checks whether a year is a leap year", "returns the intersection of two lists",
        "implements binary search", "counts how often each character appears in a string", "rotates a list by k positions",
        "validates an email address with a regular expression", "transposes a matrix", "computes the power set of a list"]
LANGS = ["Python", "Python", "Python", "JavaScript", "C"]
CONCEPTS = ["photosynthesis", "gravity", "inflation", "machine learning", "the water cycle", "compound interest",
            "how vaccines work", "black holes", "the stock market", "recursion", "blockchain", "climate change",
            "the immune system", "supply and demand", "electricity", "DNA", "the internet", "plate tectonics",
            "evolution", "a neural network", "the greenhouse effect", "democracy", "how a car engine works",
            "the theory of relativity", "a hash table", "encryption", "the French Revolution", "volcanoes",
            "the Pythagorean theorem", "probability", "object-oriented programming", "the solar system",
            "how batteries work", "the scientific method", "opportunity cost", "tides", "cloud computing",
            "sleep", "the placebo effect", "a recession"]
ACTIVITIES = ["staying focused while studying", "saving money", "sleeping better", "learning a new language",
              "running a first marathon", "keeping houseplants alive", "writing a good resume", "public speaking",
              "cooking healthy meals on a budget", "reducing stress", "starting a vegetable garden",
              "managing time at work", "making new friends in a new city", "preparing for a job interview",
              "traveling with little luggage", "learning to play the guitar", "staying safe online",
              "writing clean code", "drinking more water", "keeping a journal", "reading more books",
              "taking better photos with a phone", "organizing a small kitchen", "working from home",
              "teaching a child to ride a bike", "giving constructive feedback", "hiking in hot weather",
              "planning a birthday party", "reducing food waste", "getting up early"]
FORMS = ["poem", "story", "haiku", "limerick", "product description", "thank-you note", "motivational message",
         "news headline and summary", "dialogue between two friends", "letter to a future self"]
TOPICS = ["the ocean", "a lost cat", "autumn leaves", "a robot learning to paint", "a rainy Monday",
          "the first day of school", "a lighthouse keeper", "a cup of coffee", "friendship", "the moon",
          "a busy city street", "a dragon who is afraid of fire", "mountains", "a small bakery", "time travel"]
PAIRS = [("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "bacteria"), ("RAM", "storage"),
         ("speed", "velocity"), ("a crocodile", "an alligator"), ("HTTP", "HTTPS"), ("stocks", "bonds"),
         ("a simile", "a metaphor"), ("mitosis", "meiosis"), ("TCP", "UDP"), ("a comet", "an asteroid"),
         ("baking soda", "baking powder"), ("affect", "effect"), ("a compiler", "an interpreter"),
         ("renewable energy", "non-renewable energy"), ("a democracy", "a monarchy"), ("git merge", "git rebase"),
         ("an ocean", "a sea"), ("precision", "recall")]
HOWTO = ["make a cup of tea", "change a flat tire", "create a virtual environment in Python", "tie a tie",
         "write a cover letter", "boil an egg", "set up a budget", "back up my computer", "make pancakes",
         "center a div in CSS", "clean a laptop keyboard", "start a podcast", "plant a tree", "use git branches",
         "write a haiku", "calculate a tip at a restaurant", "improve my handwriting", "meditate",
         "make a paper airplane", "read a nutrition label", "install a Python package", "write a unit test in Python",
         "fold a shirt neatly", "brew coffee with a French press", "remove a stain from a shirt"]
WHAT = ["a prime number", "an API", "a carbon footprint", "the speed of light", "a haiku", "an algorithm",
        "the capital of France", "a mortgage", "a noun", "a microchip", "the largest planet in the solar system",
        "a database", "an ecosystem", "a square root", "a sonnet", "an atom", "the Great Wall of China",
        "a spreadsheet", "a calorie", "a galaxy"]
SENTENCES = ["hey, can u send me the file asap", "the meeting got moved cuz the boss is sick",
             "this product is super cool and everyone should buy it", "i dunno if i can come tomorrow",
             "the results were kinda bad but we learned stuff", "thanks a lot for the help yesterday",
             "we gotta fix this bug before friday", "the food was ok but the service was slow",
             "can we talk about the project later", "my computer broke again so im late"]
STYLES = ["more formal", "shorter", "more polite", "more enthusiastic"]


def build() -> list[str]:
    """All prompts, shuffled with a fixed seed so each kind is spread over the file."""
    rnd = random.Random(0)
    p = [f"Write a {rnd.choice(LANGS)} function that {c}." for c in CODE]
    p += [f"Explain {c} in simple terms." for c in CONCEPTS]
    p += [f"Give me three tips for {a}." for a in ACTIVITIES]
    p += [f"Write a short {f} about {rnd.choice(TOPICS)}." for f in FORMS for _ in range(3)]
    p += [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    p += [f"How do I {h}?" for h in HOWTO]
    p += [f"What is {w}?" for w in WHAT]
    p += [f"Rewrite this sentence to be {rnd.choice(STYLES)}: \"{s}\"" for s in SENTENCES]
    p += [f"What is {a} times {b}? Show your steps." for a, b in [(rnd.randint(12, 99), rnd.randint(3, 19)) for _ in range(15)]]
    p += [f"Summarize the main idea of {c} in two sentences." for c in CONCEPTS[:20]]
    p += [f"List five facts about {t}." for t in TOPICS]
    p += [f"Write a short email asking a colleague about {a}." for a in ACTIVITIES[:15]]
    p += _grid(rnd)
    rnd.shuffle(p)
    return p


GRID = {
    "concept": ["Explain {} to a ten-year-old.", "What are the most common misconceptions about {}?",
                "Write a quiz with three questions about {}.", "Why is {} important?",
                "Give an analogy that helps explain {}.", "Write a short paragraph introducing {}.",
                "What are the pros and cons of {}?", "How would you teach {} to a beginner?",
                "Write a tweet about {}.", "What questions should I ask to understand {} better?"],
    "activity": ["Make a one-week plan for {}.", "What are common mistakes people make when {}?",
                 "Write a checklist for {}.", "Explain why {} matters.", "What equipment do I need for {}?",
                 "Write a motivational message for someone who struggles with {}."],
    "topic": ["Describe {} in vivid detail.", "Write a two-sentence horror story about {}.",
              "Write a children's story opening about {}.", "Give three creative titles for a story about {}.",
              "Write a riddle whose answer is {}."],
    "code": ["Explain step by step how you would write a program that {}.",
             "Write a Python function that {} and add a docstring.", "Write unit tests for a function that {}.",
             "What edge cases matter for a function that {}?"],
}


def _grid(rnd: random.Random) -> list[str]:
    """Template x subject prompts (each subject list crossed with its templates)."""
    subjects = {"concept": CONCEPTS, "activity": ACTIVITIES, "topic": TOPICS + [w for w in WHAT], "code": CODE}
    return [t.format(s) for kind, templates in GRID.items() for t in templates for s in subjects[kind]]


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "src" / "spec_train" / "prompts.jsonl"
    prompts = build()
    out.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in prompts))
    print(f"{len(prompts)} prompts -> {out}")
