"""Deterministic generator of simple English text: the training corpus of the bundled tiny model.

The corpus ships as code, so the model can be rebuilt anywhere without downloading anything. It mixes
short children's stories, simple facts, dialogues and ChatML-formatted question/answer exchanges over a
closed vocabulary of about a thousand words. Every English word the generator can emit lives in the
constant tables below (templates fill `{slot}`s only with table entries), so `VOCABULARY` is exact:
a model trained on this text that writes a word outside it has not learned the corpus.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator

# (boy name, girl name) pools; the pronoun follows the pool.
BOY_NAMES = ("Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Dan", "Finn", "Noah", "Owen", "Luke")
GIRL_NAMES = ("Lily", "Mia", "Anna", "Sue", "Emma", "Lucy", "Zoe", "Ella", "Rose", "Amy", "Kate", "Nora")

# name, plural, sound, legs, home, food
ANIMALS = (
    ("cat", "cats", "meow", "four", "in a house", "fish"),
    ("dog", "dogs", "woof", "four", "in a house", "meat"),
    ("cow", "cows", "moo", "four", "on a farm", "grass"),
    ("duck", "ducks", "quack", "two", "by a pond", "bread"),
    ("bird", "birds", "tweet", "two", "in a tree", "seeds"),
    ("sheep", "sheep", "baa", "four", "on a farm", "grass"),
    ("horse", "horses", "neigh", "four", "on a farm", "hay"),
    ("pig", "pigs", "oink", "four", "on a farm", "corn"),
    ("frog", "frogs", "ribbit", "four", "by a pond", "flies"),
    ("lion", "lions", "roar", "four", "in the jungle", "meat"),
    ("owl", "owls", "hoot", "two", "in a tree", "mice"),
    ("mouse", "mice", "squeak", "four", "in a field", "cheese"),
    ("bee", "bees", "buzz", "six", "in a hive", "honey"),
    ("hen", "hens", "cluck", "two", "on a farm", "corn"),
    ("goat", "goats", "bleat", "four", "on a hill", "grass"),
    ("bear", "bears", "growl", "four", "in the woods", "berries"),
)
ADJECTIVES = (
    "little",
    "big",
    "happy",
    "kind",
    "brave",
    "small",
    "funny",
    "clever",
    "shy",
    "curious",
    "gentle",
)
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "brown", "white", "black")
OBJECTS = ("ball", "kite", "hat", "book", "box", "cup", "toy car", "drum", "doll", "boat", "bag", "flower")
PLACES = ("park", "beach", "forest", "garden", "lake", "market", "school", "farm", "zoo", "river", "hill")
HIDING_SPOTS = ("bed", "table", "tree", "big rock", "chair", "bush", "door", "bridge")
FEELINGS = ("happy", "sad", "scared", "tired", "excited", "hungry", "surprised", "proud", "sleepy")
FOODS = ("apples", "bread", "cake", "soup", "cookies", "rice", "eggs", "carrots", "pie", "milk")
# base form, past form
ACTIVITIES = (
    ("play", "played"),
    ("run", "ran"),
    ("sing", "sang"),
    ("dance", "danced"),
    ("jump", "jumped"),
    ("swim", "swam"),
    ("read books", "read books"),
    ("draw pictures", "drew pictures"),
    ("bake cakes", "baked cakes"),
    ("fly kites", "flew kites"),
    ("climb trees", "climbed trees"),
    ("build sand castles", "built sand castles"),
)
THING_COLORS = (
    ("sky", "blue"),
    ("grass", "green"),
    ("sun", "yellow"),
    ("snow", "white"),
    ("sea", "blue"),
    ("night", "dark"),
    ("banana", "yellow"),
    ("carrot", "orange"),
    ("leaf", "green"),
    ("cloud", "white"),
    ("strawberry", "red"),
    ("coal", "black"),
)
OPPOSITES = (
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("day", "night"),
    ("happy", "sad"),
    ("fast", "slow"),
    ("old", "new"),
    ("wet", "dry"),
    ("open", "closed"),
    ("light", "dark"),
    ("loud", "quiet"),
    ("full", "empty"),
)
NUMBERS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)  # fmt: skip
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
PLAIN_FACTS = (
    "In winter it is cold and in summer it is hot.",
    "The sun rises in the morning and sets in the evening.",
    "Fish live in water and birds fly in the sky.",
    "Rain falls from the clouds.",
    "Plants need water and light to grow.",
    "A week has seven days.",
    "We sleep at night and play in the day.",
    "Ice is cold and fire is hot.",
    "The moon shines at night.",
    "Trees have green leaves in summer.",
    "Milk comes from cows.",
    "Bees make honey.",
)
STORY_OPENINGS = (
    "Once upon a time, there was a {adj} {animal} named {name}.",
    "Once upon a time, there was a {adj} {kid} named {name}.",
    "There was a {adj} {kid} named {name} who lived in a small house.",
    "There was once a {adj} {animal} called {name} who lived {home}.",
)
# Episodes of a story: each is a run of sentences told in order; a story picks some of them, in order.
STORY_INTROS = (
    "{Pron} loved to {activity}.",
    "{Pron} had a {color} {object}.",
    "{Pron} liked to eat {food}.",
)
STORY_TRIP = (
    "One day, {name} went to the {place} with {pos} friend {friend}.",
    "At the {place}, they saw a big {animal2}.",
    'The {animal2} said, "{Sound2}!"',
    "{name} felt {feeling}.",
)
STORY_EPISODES = (
    ('{friend} said, "Let us {activity} together!"', "They {activity_past} all day."),
    ("Then it started to rain, so they ran under a tree.", "Soon the sun came out and the sky was blue."),
    (
        "{name} lost {pos} {color} {object}.",
        "{friend} helped {obj} look for it.",
        "They found it under the {spot}.",
        '"Thank you, {friend}!" said {name}.',
    ),
    ("{name} shared {pos} {food} with {friend}.", "They ate it all together."),
)
STORY_ENDINGS = (
    "At the end of the day, {name} went home. {Pron} was very happy.",
    "From that day on, {name} and {friend} were best friends.",
    "That night, {name} went to bed with a big smile.",
    "{name} learned that it is good to share with friends.",
)
DIALOGUE_LINES = (
    ('"Hello, {b}! How are you today?"', '"I am {feeling}, thank you. And you?"'),
    ('"Do you want to play with my {object}?"', '"Yes, please! I love your {color} {object}."'),
    ('"Where are you going?"', '"I am going to the {place} to {activity}."'),
    ('"What do you like to eat?"', '"I like to eat {food}."'),
    ('"Can you help me find my {object}?"', '"Yes, I can help you. Let us look under the {spot}."'),
    ('"Look at that {animal}!"', '"It says {sound}! It is so funny."'),
    ('"What is your favorite color?"', '"My favorite color is {color}."'),
    ('"Good night, {b}."', '"Good night, {a}. See you tomorrow."'),
)
CHAT_PAIRS = (
    ("What sound does a {animal} make?", "A {animal} says {sound}."),
    ("How many legs does a {animal} have?", "A {animal} has {legs} legs."),
    ("Where does a {animal} live?", "A {animal} lives {home}."),
    ("What do {animals} eat?", "{Animals} like to eat {animal_food}."),
    ("What is {x} plus {y}?", "{X} plus {y} is {sum}."),
    ("What color is the {thing}?", "The {thing} is {thing_color}."),
    ("What comes after {day}?", "After {day} comes {next_day}."),
    ("What is the opposite of {word}?", "The opposite of {word} is {antonym}."),
    ("Hello!", "Hello! How can I help you today?"),
    ("Who are you?", "I am a small helper. I can tell stories and answer simple questions."),
)
STORY_REQUESTS = ("Tell me a story.", "Tell me a story about a {animal}.", "Can you tell me a short story?")
FACT_TEMPLATES = (
    *(answer for _, answer in CHAT_PAIRS[:8]),
    "The {animal} says {sound} and the {animal2} says {sound2}.",
)
SPEECH_VERBS = ("said", "asked", "replied", "answered")
CHAT_ROLES = ("user", "assistant")
KIDS = ("boy", "girl")
# (subject, possessive, object) pronouns of a boy and of a girl
PRONOUNS = (("he", "his", "him"), ("she", "her", "her"))
STORY_CLOSERS = ("The end.",)

_SLOT_RE = re.compile(r"\{\w+\}")
_WORD_RE = re.compile(r"[A-Za-z]+")


def _strings(table: object) -> Iterator[str]:
    if isinstance(table, str):
        yield table
    elif isinstance(table, tuple):
        for item in table:
            yield from _strings(item)


def _vocabulary() -> frozenset[str]:
    tables = [value for name, value in globals().items() if name.isupper() and isinstance(value, tuple)]
    words: set[str] = set()
    for text in _strings(tuple(tables)):
        words.update(w.lower() for w in _WORD_RE.findall(_SLOT_RE.sub(" ", text)))
    return frozenset(words)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _slots(rng: random.Random) -> dict[str, str]:
    """One consistent cast and setting; every template's slots are filled from here."""
    is_boy = rng.random() < 0.5
    name = rng.choice(BOY_NAMES if is_boy else GIRL_NAMES)
    pron, pos, obj = PRONOUNS[0] if is_boy else PRONOUNS[1]
    friend = rng.choice([n for n in BOY_NAMES + GIRL_NAMES if n != name])
    animal, animal2 = rng.sample(ANIMALS, 2)
    activity, activity_past = rng.choice(ACTIVITIES)
    x = rng.randrange(0, 11)
    y = rng.randrange(0, 11)
    thing, thing_color = rng.choice(THING_COLORS)
    day_index = rng.randrange(len(DAYS))
    word, antonym = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        word, antonym = antonym, word
    slots = {
        "name": name,
        "friend": friend,
        "kid": KIDS[0] if is_boy else KIDS[1],
        "pron": pron,
        "pos": pos,
        "obj": obj,
        "adj": rng.choice(ADJECTIVES),
        "animal": animal[0],
        "animals": animal[1],
        "sound": animal[2],
        "legs": animal[3],
        "home": animal[4],
        "animal_food": animal[5],
        "food": rng.choice(FOODS),
        "animal2": animal2[0],
        "sound2": animal2[2],
        "color": rng.choice(COLORS),
        "object": rng.choice(OBJECTS),
        "place": rng.choice(PLACES),
        "spot": rng.choice(HIDING_SPOTS),
        "feeling": rng.choice(FEELINGS),
        "activity": activity,
        "activity_past": activity_past,
        "x": NUMBERS[x],
        "y": NUMBERS[y],
        "sum": NUMBERS[x + y],
        "thing": thing,
        "thing_color": thing_color,
        "day": DAYS[day_index],
        "next_day": DAYS[(day_index + 1) % len(DAYS)],
        "word": word,
        "antonym": antonym,
    }
    # NOTE: "{Pron}" and friends give the capitalised form at the start of a sentence.
    slots.update({_cap(k): _cap(v) for k, v in list(slots.items())})
    return slots


def _story(rng: random.Random, slots: dict[str, str]) -> str:
    opening = rng.choice(STORY_OPENINGS)
    intro_ids = sorted(rng.sample(range(len(STORY_INTROS)), rng.randint(1, 2)))
    # NOTE: episodes keep table order and the trip always comes first, so the friend is introduced
    # before "they" and a lost toy is lost before it is found.
    episode_ids = sorted(rng.sample(range(len(STORY_EPISODES)), rng.randint(1, 3)))
    sentences = [opening, *(STORY_INTROS[i] for i in intro_ids), *STORY_TRIP]
    for i in episode_ids:
        sentences.extend(STORY_EPISODES[i])
    sentences.append(rng.choice(STORY_ENDINGS))
    if rng.random() < 0.3:
        sentences.append(rng.choice(STORY_CLOSERS))
    return " ".join(s.format(**slots) for s in sentences)


def _facts(rng: random.Random, slots: dict[str, str]) -> str:
    sentences = []
    for _ in range(rng.randint(3, 6)):
        if rng.random() < 0.25:
            sentences.append(rng.choice(PLAIN_FACTS))
        else:
            sentences.append(_cap(rng.choice(FACT_TEMPLATES).format(**slots)))
        slots = _slots(rng)
    return " ".join(sentences)


def _dialogue(rng: random.Random, slots: dict[str, str]) -> str:
    a, b = slots["name"], slots["friend"]
    lines = []
    for first, second in rng.sample(DIALOGUE_LINES, rng.randint(2, 4)):
        fill = {**slots, "a": a, "b": b}
        lines.append(f"{a} {rng.choice(SPEECH_VERBS[:2])}, {first.format(**fill)}")
        lines.append(f"{b} {rng.choice(SPEECH_VERBS[2:] + SPEECH_VERBS[:1])}, {second.format(**fill)}")
    return "\n".join(lines)


def _chat(rng: random.Random, slots: dict[str, str]) -> str:
    if rng.random() < 0.25:
        question = rng.choice(STORY_REQUESTS).format(**slots)
        answer = _story(rng, slots)
    else:
        question_t, answer_t = rng.choice(CHAT_PAIRS)
        question, answer = question_t.format(**slots), answer_t.format(**slots)
    return (
        f"<|im_start|>{CHAT_ROLES[0]}\n{question}<|im_end|>\n<|im_start|>{CHAT_ROLES[1]}\n{answer}<|im_end|>"
    )


_KINDS: tuple[tuple[float, Callable[[random.Random, dict[str, str]], str]], ...] = (
    (0.45, _story),
    (0.2, _facts),
    (0.15, _dialogue),
    (0.2, _chat),
)


def generate_documents(num_chars: int, seed: int) -> list[str]:
    """Documents (stories, facts, dialogues, ChatML chats) totalling at least `num_chars` characters.

    Deterministic for a given (num_chars, seed) on every machine: it only draws from a seeded
    `random.Random` and iterates over tuples, never over sets or dicts of unordered keys.
    """
    rng = random.Random(seed)
    weights = [w for w, _ in _KINDS]
    documents: list[str] = []
    total = 0
    while total < num_chars:
        make = rng.choices([k for _, k in _KINDS], weights)[0]
        document = make(rng, _slots(rng))
        documents.append(document)
        total += len(document) + 2
    return documents


def generate_corpus(num_chars: int, seed: int) -> str:
    """The documents of `generate_documents` joined by blank lines."""
    return "\n\n".join(generate_documents(num_chars, seed))


VOCABULARY: frozenset[str] = _vocabulary()
