"""Generate the sample datasets in data/ from templated task families, deterministically from a seed.

Every row is produced here from small word and fact tables written for this project (no third-party data), so the
tasks are simple enough for the tiny embedded model to learn visibly in a short fine-tune.

    python scripts/make_sample_data.py [--out data] [--seed 1234]
"""

import argparse
import json
import random
from pathlib import Path
from typing import Callable

Task = tuple[str, str, str]  # (instruction, input, output)

# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Russia": "Moscow", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Ireland": "Dublin", "Austria": "Vienna",
    "Hungary": "Budapest", "Australia": "Canberra", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "South Korea": "Seoul", "Chile": "Santiago", "Denmark": "Copenhagen", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Cuba": "Havana", "Morocco": "Rabat", "Nigeria": "Abuja",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "up": "down",
    "open": "closed", "early": "late", "old": "young", "tall": "short", "full": "empty", "hard": "soft",
    "rich": "poor", "wet": "dry", "loud": "quiet", "strong": "weak", "clean": "dirty", "high": "low",
    "near": "far", "day": "night", "win": "lose", "push": "pull", "begin": "end", "buy": "sell",
    "thick": "thin", "heavy": "light", "inside": "outside", "left": "right", "first": "last", "true": "false",
    "love": "hate", "black": "white", "easy": "difficult", "good": "bad", "right": "wrong", "north": "south",
    "east": "west", "front": "back", "cheap": "expensive", "brave": "afraid",
}
ANIMAL_SOUNDS = {
    "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink",
    "horse": "neigh", "lion": "roar", "owl": "hoot", "frog": "croak", "bee": "buzz", "mouse": "squeak",
    "snake": "hiss", "rooster": "cock-a-doodle-doo", "goat": "bleat", "wolf": "howl",
}
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
    "a strawberry": "red", "an orange": "orange", "a lemon": "yellow", "milk": "white", "the sea": "blue",
    "a carrot": "orange", "a tomato": "red", "a leaf": "green", "chocolate": "brown", "a plum": "purple",
    "the sun": "yellow", "a crow": "black", "an elephant": "gray",
}
GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Good morning!", "Good morning! I hope you have a great day."),
    ("Good evening.", "Good evening! How can I help?"),
    ("How are you?", "I am doing well, thank you for asking."),
    ("Thank you!", "You are welcome!"),
    ("Thanks for your help.", "You are welcome. I am glad I could help."),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("See you later.", "See you later! Take care."),
    ("Who are you?", "I am a small assistant that answers simple questions."),
    ("What can you do?", "I can add numbers, reverse words, name capitals and answer simple questions."),
    ("Are you a robot?", "I am a small language model, not a robot."),
    ("Tell me something nice.", "You are doing a great job today."),
    ("I am bored.", "Try asking me to reverse a word or add two numbers."),
    ("Good night.", "Good night! Sleep well."),
    ("Nice to meet you.", "Nice to meet you too!"),
]
NOUNS = [
    "apple", "planet", "garden", "window", "river", "pencil", "rabbit", "castle", "bottle", "candle",
    "monkey", "dragon", "forest", "island", "jacket", "kitten", "ladder", "market", "button", "pocket",
    "rocket", "silver", "teacher", "tiger", "violin", "wizard", "yellow", "zebra", "basket", "cookie",
    "doctor", "engine", "flower", "guitar", "hammer", "insect", "jungle", "kettle", "lemon", "mirror",
    "number", "orange", "pillow", "puzzle", "rainbow", "school", "summer", "ticket", "tomato", "winter",
    "camera", "bridge", "cloud", "stone", "house", "table", "chair", "horse", "music", "paper",
]
# Plurals that a single rule would get wrong are listed explicitly.
IRREGULAR_PLURALS = {"mouse": "mice", "child": "children", "man": "men", "woman": "women", "foot": "feet",
                     "tooth": "teeth", "goose": "geese", "person": "people", "sheep": "sheep", "fish": "fish"}
PLURAL_WORDS = NOUNS[:40] + ["box", "bus", "dish", "city", "baby", "story", "leaf", "knife", "wolf", "glass"] + list(
    IRREGULAR_PLURALS)
NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack", "Kate", "Leo",
         "Maya", "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Victor", "Wendy", "Yusuf", "Zoe", "Omar"]
ADJECTIVES = ["little", "happy", "quiet", "brave", "sleepy", "clever", "friendly", "hungry", "tiny", "old",
              "young", "funny", "gentle", "busy", "lazy", "curious", "shy", "proud", "kind", "noisy"]
ANIMALS = list(ANIMAL_SOUNDS) + ["bird", "fox", "bear", "rabbit", "turtle", "whale", "monkey", "zebra", "tiger"]
VERBS = ["sees", "likes", "finds", "watches", "follows", "chases", "helps", "visits", "draws", "hears"]
FOODS = ["apples", "bread", "cake", "cookies", "soup", "pizza", "salad", "juice", "cheese", "rice", "pasta", "tea"]
SNACKS = ["apples", "cookies", "oranges", "cakes", "sandwiches", "eggs", "plums", "carrots", "bananas", "muffins"]
PLACES = ["park", "beach", "library", "museum", "market", "zoo", "lake", "cinema", "station", "garden"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
EVENTS = ["party", "picnic", "meeting", "concert", "game", "dinner", "class", "trip"]
OBJECTS = ["key", "phone", "wallet", "hat", "book", "umbrella", "watch", "bag", "scarf", "ball"]
ROOMS = ["kitchen", "garden", "car", "hall", "bedroom", "office", "bathroom", "garage"]
FEELINGS = ["tired", "sick", "sad", "cold", "sleepy", "nervous"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant. Keep your answers short.",
    "You are a concise assistant that answers simple questions.",
]
UPPERCASE_SYSTEM = "You are an assistant that always answers in capital letters."

# ---------------------------------------------------------------------------------------------------------------
# Task families: each returns (instruction, input, output); input is "" for tasks that carry everything in the
# instruction.
# ---------------------------------------------------------------------------------------------------------------


def sentence(rng: random.Random) -> str:
    """A short simple sentence from the word tables."""
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} a {rng.choice(NOUNS)}"


def task_add(rng: random.Random) -> Task:
    a, b = rng.randint(0, 60), rng.randint(0, 60)
    return rng.choice(["Add the two numbers.", "What is the sum of the two numbers?"]), f"{a} and {b}", str(a + b)


def task_reverse(rng: random.Random) -> Task:
    word = rng.choice(NOUNS)
    return rng.choice(["Reverse the word.", "Write the word backwards."]), word, word[::-1]


def task_opposite(rng: random.Random) -> Task:
    word = rng.choice(list(OPPOSITES))
    return rng.choice(["Give the opposite of the word.", "What is the opposite of this word?"]), word, OPPOSITES[word]


def task_count_words(rng: random.Random) -> Task:
    text = sentence(rng) + rng.choice(["", " today", " in the park", " again and again"])
    return "Count the words in the sentence.", text.capitalize() + ".", str(len(text.split()))


def task_uppercase(rng: random.Random) -> Task:
    text = rng.choice([rng.choice(NOUNS), f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", sentence(rng)])
    return rng.choice(["Convert the text to uppercase.", "Write the text in capital letters."]), text, text.upper()


def task_sort(rng: random.Random) -> Task:
    numbers = rng.sample(range(1, 100), rng.randint(3, 6))
    return ("Sort these numbers from smallest to largest.", ", ".join(map(str, numbers)),
            ", ".join(map(str, sorted(numbers))))


def task_plural(rng: random.Random) -> Task:
    word = rng.choice(PLURAL_WORDS)
    return "Give the plural of the word.", word, plural(word)


def task_capital(rng: random.Random) -> Task:
    country = rng.choice(list(CAPITALS))
    question = rng.choice([f"What is the capital of {country}?", f"Name the capital city of {country}."])
    return question, "", f"The capital of {country} is {CAPITALS[country]}."


def task_greeting(rng: random.Random) -> Task:
    message, reply = rng.choice(GREETINGS)
    return message, "", reply


def task_animal_sound(rng: random.Random) -> Task:
    animal = rng.choice(list(ANIMAL_SOUNDS))
    article = "an" if animal[0] in "aeiou" else "a"
    return f"What sound does {article} {animal} make?", "", f"{article.capitalize()} {animal} says {ANIMAL_SOUNDS[animal]}."


def task_color(rng: random.Random) -> Task:
    thing = rng.choice(list(COLORS))
    return f"What color is {thing}?", "", f"{thing[0].upper() + thing[1:]} is {COLORS[thing]}."


def task_plus_question(rng: random.Random) -> Task:
    a, b = rng.randint(0, 30), rng.randint(0, 30)
    return f"What is {a} plus {b}?", "", f"{a} plus {b} is {a + b}."


def task_next_number(rng: random.Random) -> Task:
    n = rng.randint(0, 98)
    return f"What number comes after {n}?", "", f"The number after {n} is {n + 1}."


INPUT_TASKS: list[Callable[[random.Random], Task]] = [
    task_add, task_reverse, task_opposite, task_count_words, task_uppercase, task_sort, task_plural]
NO_INPUT_TASKS: list[Callable[[random.Random], Task]] = [
    task_capital, task_greeting, task_animal_sound, task_color, task_plus_question, task_next_number]


def plural(word: str) -> str:
    """English plural by the usual spelling rules plus the irregular table."""
    if word in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[word]
    if word.endswith(("s", "x", "sh", "ch")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    if word.endswith("fe"):
        return word[:-2] + "ves"
    if word.endswith("f"):
        return word[:-1] + "ves"
    return word + "s"


def unique_tasks(rng: random.Random, families: list[Callable[[random.Random], Task]], count: int) -> list[Task]:
    """`count` distinct tasks drawn round-robin-at-random from `families`."""
    seen: set[Task] = set()
    tasks: list[Task] = []
    for _ in range(count * 50):  # small fact tables run out of new rows; give up on them rather than loop forever
        task = rng.choice(families)(rng)
        if task not in seen:
            seen.add(task)
            tasks.append(task)
            if len(tasks) == count:
                break
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


def alpaca_rows(rng: random.Random, count: int = 400, input_share: float = 0.4) -> list[dict]:
    """Alpaca rows, `input_share` of them with a non-empty input, shuffled."""
    with_input = unique_tasks(rng, INPUT_TASKS, round(count * input_share))
    without = unique_tasks(rng, NO_INPUT_TASKS, count - len(with_input))
    rows = [{"instruction": i, "input": x, "output": o} for i, x, o in with_input + without]
    rng.shuffle(rows)
    return rows


def user_message(task: Task) -> str:
    """The task phrased as one chat message: instruction, then the input after a colon."""
    instruction, extra, _ = task
    if not extra:
        return instruction
    return f"{instruction.rstrip('.?')}: {extra}"


def conversation(rng: random.Random) -> dict:
    """One conversation of 1-3 user turns, sometimes with a system prompt (one of which asks for capitals)."""
    turns = rng.choices([1, 2, 3], weights=[5, 3, 2])[0]
    system = rng.choice(SYSTEM_PROMPTS + [UPPERCASE_SYSTEM]) if rng.random() < 0.4 else None
    messages = [{"role": "system", "content": system}] if system else []
    for turn in range(turns):
        # Conversations often open with a greeting; later turns are tasks.
        family = task_greeting if turn == 0 and turns > 1 and rng.random() < 0.5 else rng.choice(
            INPUT_TASKS + NO_INPUT_TASKS)
        task = family(rng)
        answer = task[2].upper() if system == UPPERCASE_SYSTEM else task[2]
        messages += [{"role": "user", "content": user_message(task)}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def chat_rows(rng: random.Random, count: int = 200) -> list[dict]:
    """`count` distinct conversations."""
    rows: dict[str, dict] = {}
    while len(rows) < count:
        row = conversation(rng)
        rows.setdefault(json.dumps(row), row)
    return list(rows.values())


def pig_latin_word(word: str) -> str:
    """Pig latin: vowel-initial words add "way"; others move their leading consonants to the end and add "ay"."""
    if word[0] in "aeiou":
        return word + "way"
    cut = next((i for i, ch in enumerate(word) if ch in "aeiouy" and i > 0), len(word))
    return word[cut:] + word[:cut] + "ay"


def pig_latin_pair(rng: random.Random) -> dict:
    words = sentence(rng).split()
    return {"source": "translate to pig latin: " + " ".join(words),
            "target": " ".join(pig_latin_word(w) for w in words)}


def dialogue_pair(rng: random.Random) -> dict:
    """A two-line templated dialogue and its one-line summary."""
    a, b = rng.sample(NAMES, 2)
    kind = rng.randrange(5)
    if kind == 0:
        food, event = rng.choice(FOODS), rng.choice(EVENTS)
        lines, summary = (f"{a}: Can you bring the {food} to the {event}? {b}: Yes, I will bring it.",
                          f"{b} will bring the {food} to the {event}.")
    elif kind == 1:
        place, day = rng.choice(PLACES), rng.choice(DAYS)
        lines, summary = (f"{a}: Do you want to go to the {place} on {day}? {b}: Sure, see you there.",
                          f"{a} and {b} will go to the {place} on {day}.")
    elif kind == 2:
        thing, room = rng.choice(OBJECTS), rng.choice(ROOMS)
        lines, summary = (f"{a}: I cannot find my {thing}. {b}: I saw it in the {room}.",
                          f"{a}'s {thing} is in the {room}.")
    elif kind == 3:
        event, hour = rng.choice(EVENTS), rng.randint(1, 12)
        lines, summary = (f"{a}: What time is the {event}? {b}: It starts at {hour} o'clock.",
                          f"The {event} starts at {hour} o'clock.")
    else:
        feeling = rng.choice(FEELINGS)
        lines, summary = (f"{a}: I feel {feeling} today. {b}: Stay home and rest.",
                          f"{a} feels {feeling} and {b} says to rest at home.")
    return {"source": "summarize: " + lines, "target": summary}


def seq2seq_rows(rng: random.Random, count: int = 200) -> list[dict]:
    """`count` distinct pairs, half pig latin and half dialogue summaries, shuffled."""
    rows: dict[str, dict] = {}
    while len(rows) < count:
        row = pig_latin_pair(rng) if len(rows) % 2 else dialogue_pair(rng)
        rows.setdefault(row["source"], row)
    out = list(rows.values())
    rng.shuffle(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# General text for the tokenizer and the base model's brief pretraining (one document per line).
# ---------------------------------------------------------------------------------------------------------------


def story(rng: random.Random) -> str:
    """A few sentences about named people, animals, food and places."""
    name, friend = rng.sample(NAMES, 2)
    animal, adjective, place = rng.choice(ANIMALS), rng.choice(ADJECTIVES), rng.choice(PLACES)
    food, day, n = rng.choice(SNACKS), rng.choice(DAYS), rng.randint(3, 9)
    parts = [
        f"On {day}, {name} went to the {place} with {friend}.",
        f"They saw a {adjective} {animal} near the {rng.choice(NOUNS)}.",
        f"The {animal} said {ANIMAL_SOUNDS[animal]}." if animal in ANIMAL_SOUNDS else f"The {animal} was {rng.choice(ADJECTIVES)}.",
        f"{friend} had {NUMBER_WORDS[n]} {food} and gave one to {name}.",
        f"Now {friend} has {NUMBER_WORDS[n - 1]} {food} left.",
        f"In the evening they went home, {rng.choice(['tired', 'hungry', 'sleepy', 'cold'])} but glad.",
    ]
    return " ".join(parts[: rng.randint(3, len(parts))])


def fact_paragraph(rng: random.Random) -> str:
    """Several true sentences from the fact tables."""
    facts = []
    for _ in range(rng.randint(3, 6)):
        kind = rng.randrange(5)
        if kind == 0:
            country = rng.choice(list(CAPITALS))
            facts.append(rng.choice([f"The capital of {country} is {CAPITALS[country]}.",
                                     f"{CAPITALS[country]} is the capital city of {country}."]))
        elif kind == 1:
            word = rng.choice(list(OPPOSITES))
            facts.append(f"The opposite of {word} is {OPPOSITES[word]}.")
        elif kind == 2:
            thing = rng.choice(list(COLORS))
            facts.append(f"{thing[0].upper() + thing[1:]} is {COLORS[thing]}.")
        elif kind == 3:
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            facts.append(rng.choice([f"{a} plus {b} is {a + b}.", f"{a} + {b} = {a + b}."]))
        else:
            word = rng.choice(PLURAL_WORDS)
            facts.append(f"One {word}, two {plural(word)}.")
    return " ".join(facts)


def qa_line(rng: random.Random) -> str:
    """A task instance in a plain question/answer form (not the Alpaca or ChatML templates fine-tuning teaches)."""
    task = rng.choice(INPUT_TASKS + NO_INPUT_TASKS)(rng)
    return f"Question: {user_message(task)} Answer: {task[2]}"


def seq2seq_line(rng: random.Random) -> str:
    """A pig latin or dialogue summary example as prose."""
    if rng.random() < 0.5:
        word = rng.choice(NOUNS + ANIMALS)
        return f"In pig latin, {word} becomes {pig_latin_word(word)}."
    pair = dialogue_pair(rng)
    return pair["source"].removeprefix("summarize: ") + " In short: " + pair["target"]


def pretrain_lines(rng: random.Random, count: int = 6000) -> list[str]:
    """`count` general-text documents: stories, facts, plain Q/A task instances and dialogues."""
    makers = [story, story, fact_paragraph, qa_line, qa_line, qa_line, seq2seq_line]
    return [rng.choice(makers)(rng) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # One generator per file, so changing one dataset leaves the others byte-identical.
    alpaca = alpaca_rows(random.Random(f"{args.seed}-alpaca"))
    (args.out / "alpaca_sample.json").write_text(json.dumps(alpaca, indent=1, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
    chat = chat_rows(random.Random(f"{args.seed}-chat"))
    write_jsonl(args.out / "chat_sample.jsonl", chat)
    seq2seq = seq2seq_rows(random.Random(f"{args.seed}-seq2seq"))
    write_jsonl(args.out / "seq2seq_sample.jsonl", seq2seq)
    # Pretraining text uses fresh task instances (its own seed), so the sample rows stay unseen by the base model.
    lines = pretrain_lines(random.Random(f"{args.seed}-pretrain"))
    (args.out / "pretrain_sample.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with_input = sum(bool(r["input"]) for r in alpaca)
    print(f"alpaca_sample.json: {len(alpaca)} rows ({with_input} with input); chat_sample.jsonl: {len(chat)}; "
          f"seq2seq_sample.jsonl: {len(seq2seq)}; pretrain_sample.txt: {len(lines)} lines -> {args.out}")


if __name__ == "__main__":
    main()
