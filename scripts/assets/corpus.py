"""The sample corpus: documents of several kinds from a template grammar over a small world, until a byte budget."""

from __future__ import annotations

import json
from typing import Callable

from scripts.assets.rng import Rng
from scripts.assets.words import (
    ADJECTIVES,
    ADVERBS,
    ANIMAL_CLASSES,
    ANIMALS,
    CITIES,
    CLOSINGS,
    CODAS,
    COOKING_VERBS,
    COUNTRIES,
    DAYS,
    DISHES,
    DWELLINGS,
    FEELINGS,
    FOODS,
    FURNITURE,
    HABITATS,
    INGREDIENTS,
    NAMES,
    OBJECTS,
    ONSETS,
    PARTS_OF_DAY,
    PAST_VERBS,
    PLACES,
    PRODUCTS,
    PRONOUNS,
    SAYINGS,
    SMALL_NUMBER_WORDS,
    TENS_WORDS,
    TIMES,
    TOWN_SUFFIXES,
    VOWELS,
    WEATHER,
)


def invented_name(rng: Rng) -> str:
    """A pronounceable made-up word: shared syllables give the tokenizers real sub-word structure to learn."""
    syllables = [rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.between(1, 2))]
    return capitalize("".join(syllables) + rng.choice(TOWN_SUFFIXES))


def number_words(n: int) -> str:
    """English words for 0 <= n < 1000."""
    if n < 20:
        return SMALL_NUMBER_WORDS[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS_WORDS[tens] + ("" if ones == 0 else "-" + SMALL_NUMBER_WORDS[ones])
    hundreds, rest = divmod(n, 100)
    return SMALL_NUMBER_WORDS[hundreds] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))


def capitalize(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ----------------------------------------------------------------------------------------------------------------
# The world: facts fixed once, so that they repeat consistently across documents (learnable structure).


class World:
    def __init__(self, rng: Rng) -> None:
        self.capitals = dict(zip(COUNTRIES, rng.pick_distinct(CITIES, len(COUNTRIES))))
        self.animal_food = {animal: rng.pick_distinct(FOODS, 2) for animal in ANIMALS}
        self.animal_home = {animal: rng.choice(HABITATS) for animal in ANIMALS}
        self.animal_weight = {animal: rng.between(1, 40) for animal in ANIMALS}
        self.animal_lifespan = {animal: rng.between(3, 30) for animal in ANIMALS}
        self.towns = sorted({invented_name(rng) for _ in range(600)})
        self.town_country = {town: rng.choice(COUNTRIES) for town in self.towns}
        self.town_product = {town: rng.choice(PRODUCTS) for town in self.towns}
        self.town_people = {town: 100 * rng.between(5, 900) for town in self.towns}


# ----------------------------------------------------------------------------------------------------------------
# Document generators: each returns one document's text.


def _character(rng: Rng, taken: set[str]) -> tuple[str, str]:
    gender = rng.choice(["she", "he"])
    name = rng.choice([n for n in NAMES[gender] if n not in taken])
    taken.add(name)
    return name, gender


def _story_sentence(rng: Rng, world: World, cast: list[tuple[str, str]]) -> str:
    (name, gender), (other, _) = cast[0], cast[-1]
    subject, obj, possessive = PRONOUNS[gender]
    thing, adj, place = rng.choice(OBJECTS), rng.choice(ADJECTIVES), rng.choice(PLACES)
    templates: list[Callable[[], str]] = [
        lambda: f"{name} {rng.choice(PAST_VERBS)} the {adj} {thing} {rng.choice(ADVERBS)}.",
        lambda: (
            f"One {rng.choice(TIMES)}, {name} found {article(adj)} {adj} {thing} under the {rng.choice(FURNITURE)}."
        ),
        lambda: f"{capitalize(subject)} walked to the {place} with {possessive} {thing}.",
        lambda: f"\u201c{rng.choice(SAYINGS)},\u201d said {name}.",
        lambda: f"{other} looked at {obj} and felt {rng.choice(FEELINGS)}.",
        lambda: f"The {thing} was {adj}, and {subject} did not know why.",
        lambda: f"Near the {place} there was {article(adj)} {adj} {rng.choice(DWELLINGS)}.",
        lambda: f"{name} and {other} {rng.choice(PAST_VERBS)} {rng.between(2, 9)} {thing}s before {rng.choice(TIMES)}.",
        lambda: f"Nobody at the {place} had seen {name} so {rng.choice(FEELINGS)}.",
        lambda: f"{name} took the train to {rng.choice(world.towns)} to buy {rng.choice(PRODUCTS)}.",
    ]
    return rng.choice(templates)()


def story(rng: Rng, world: World) -> str:
    taken: set[str] = set()
    cast = [_character(rng, taken) for _ in range(rng.between(1, 3))]
    name, _ = cast[0]
    weather, weather_line = rng.choice(WEATHER)
    home_adjective = rng.choice(ADJECTIVES)
    opening = (
        f"{name} lived in {article(home_adjective)} {home_adjective} {rng.choice(DWELLINGS)} "
        f"near the {rng.choice(PLACES)}. It was a {weather} {rng.choice(PARTS_OF_DAY)}, and {weather_line}."
    )
    paragraphs = [opening]
    for _ in range(rng.between(2, 5)):
        paragraphs.append(" ".join(_story_sentence(rng, world, cast) for _ in range(rng.between(3, 6))))
    paragraphs.append(f"In the end, {name} went home and slept until the {rng.choice(TIMES)}.")
    return "\n\n".join(paragraphs)


def encyclopedia(rng: Rng, world: World) -> str:
    animal = rng.choice(ANIMALS)
    food_a, food_b = world.animal_food[animal]
    weight = world.animal_weight[animal]
    lines = [
        f"The {animal} is {article(ANIMAL_CLASSES[animal])} {ANIMAL_CLASSES[animal]} that lives in the "
        f"{world.animal_home[animal]}.",
        f"It eats mostly {food_a} and sometimes {food_b}.",
        f"An adult {animal} weighs about {weight} kilograms and lives for {world.animal_lifespan[animal]} years.",
        f"The {animal} is most active in the {rng.choice(PARTS_OF_DAY)}.",
    ]
    if rng.chance(0.5):
        lines.append(f"A young {animal} weighs about {max(1, weight // 4)} kilograms when it leaves its parents.")
    if rng.chance(0.5):
        lines.append(f"In {rng.choice(COUNTRIES)}, the {animal} appears on {article('old')} old {rng.choice(OBJECTS)}.")
    return f"{capitalize(animal)}\n\n" + " ".join(lines)


def recipe(rng: Rng, world: World) -> str:
    dish = rng.choice(DISHES)
    chosen = rng.pick_distinct(INGREDIENTS, rng.between(3, 6))
    lines = [f"{capitalize(rng.choice(ADJECTIVES))} {dish} for {rng.between(2, 8)} people", "", "Ingredients:"]
    for name, unit in chosen:
        amount = rng.between(1, 5) if unit != "grams" else 50 * rng.between(1, 8)
        lines.append(f"- {amount} {unit + ' of ' if unit else ''}{name}")
    lines += ["", "Steps:"]
    for step, (name, _) in enumerate(chosen, start=1):
        lines.append(f"{step}. {rng.choice(COOKING_VERBS)} the {name} {rng.choice(ADVERBS)}.")
    minutes = 5 * rng.between(2, 12)
    lines.append(f"{len(chosen) + 1}. Cook for {minutes} minutes at {10 * rng.between(15, 22)} °C and serve warm.")
    return "\n".join(lines)


def arithmetic(rng: Rng, world: World) -> str:
    lines = []
    for _ in range(rng.between(6, 14)):
        a, b = rng.between(0, 99), rng.between(0, 99)
        kind = rng.below(4)
        if kind == 0:
            lines.append(f"{a} + {b} = {a + b}")
        elif kind == 1:
            big, small = max(a, b), min(a, b)
            lines.append(f"{big} - {small} = {big - small}")
        elif kind == 2:
            a, b = a % 13, b % 13
            lines.append(f"{a} × {b} = {a * b}")
        else:
            a, b = a % 20, b % 20
            lines.append(f"{capitalize(number_words(a))} plus {number_words(b)} is {number_words(a + b)}.")
    return "Practice sums\n\n" + "\n".join(lines)


def letter(rng: Rng, world: World) -> str:
    taken: set[str] = set()
    writer, reader = _character(rng, taken), _character(rng, taken)
    country = rng.choice(COUNTRIES)
    body = [
        f"I am writing to you from {world.capitals[country]}, the capital of {country}.",
        " ".join(_story_sentence(rng, world, [writer, reader]) for _ in range(rng.between(2, 4))),
        f"The weather here is {rng.choice(WEATHER)[0]}, and the {rng.choice(PLACES)} is full of people.",
    ]
    return f"Dear {reader[0]},\n\n" + "\n\n".join(body) + f"\n\n{rng.choice(CLOSINGS)},\n{writer[0]}"


def weather_report(rng: Rng, world: World) -> str:
    country = rng.choice(COUNTRIES)
    lines = [f"Weather for {world.capitals[country]}, {country}", ""]
    for day in DAYS:
        high = rng.between(-5, 32)
        low = high - rng.between(3, 12)
        lines.append(f"{day}: {rng.choice(WEATHER)[0]}, high of {high} °C, low of {low} °C.")
    return "\n".join(lines)


def quiz(rng: Rng, world: World) -> str:
    lines = []
    for _ in range(rng.between(3, 7)):
        if rng.chance(0.6):
            country = rng.choice(COUNTRIES)
            lines.append(
                f"Q: What is the capital of {country}?\nA: The capital of {country} is {world.capitals[country]}."
            )
        else:
            animal = rng.choice(ANIMALS)
            food = world.animal_food[animal][0]
            lines.append(f"Q: What does the {animal} eat?\nA: The {animal} eats mostly {food}.")
    return "\n\n".join(lines)


def gazetteer(rng: Rng, world: World) -> str:
    entries = []
    for town in rng.pick_distinct(world.towns, rng.between(2, 5)):
        country = world.town_country[town]
        distance = rng.between(5, 400)
        entries.append(
            f"{town} is a town in {country}, {distance} kilometres from {world.capitals[country]}, the capital. "
            f"About {world.town_people[town]:,} people live there. {town} is known for its "
            f"{world.town_product[town]}, and its {rng.choice(PLACES)} is {rng.choice(ADJECTIVES)}."
        )
    return "Towns\n\n" + "\n\n".join(entries)


GENERATORS: list[tuple[Callable[[Rng, World], str], int]] = [
    (story, 6),
    (encyclopedia, 3),
    (recipe, 2),
    (arithmetic, 2),
    (letter, 2),
    (weather_report, 1),
    (quiz, 2),
    (gazetteer, 3),
]


def generate_documents(seed: int, target_bytes: int) -> list[str]:
    """Documents until their jsonl lines add up to ``target_bytes``."""
    rng = Rng(seed)
    world = World(rng)
    weighted = [gen for gen, weight in GENERATORS for _ in range(weight)]
    documents, total = [], 0
    while total < target_bytes:
        text = rng.choice(weighted)(rng, world)
        documents.append(text)
        total += len(jsonl_line(text).encode("utf-8"))
    return documents


def jsonl_line(text: str) -> str:
    return json.dumps({"text": text}, ensure_ascii=False) + "\n"
