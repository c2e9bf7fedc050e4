"""Build the bundled offline assets: a sample corpus and two small tokenizers trained on it.

    python scripts/make_assets.py            # writes ./assets/ next to this script's repository
    python scripts/make_assets.py --out DIR  # writes DIR/data/sample/sample.jsonl and DIR/tokenizer/*.model

Everything here is deterministic: the corpus comes from our own template grammar driven by a fixed-seed
SplitMix64 generator (no ``random``, whose algorithms may change between Python versions), the tiktoken-format
BPE comes from the small trainer below, and sentencepiece trains on one thread from an in-memory iterator (so no
file path is recorded in the model). Running the script twice gives byte-identical files; ``assets/README.md``
describes what the files are and where the text comes from.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import io
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

import regex

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_SEED = 20240611
CORPUS_BYTES = 2_000_000  # stop adding documents once the jsonl holds this many bytes
TIKTOKEN_RANKS = 2000  # 256 single bytes + 1744 merges
SENTENCEPIECE_VOCAB = 2000
# The Llama 3 pre-tokenizer pattern; the trainer must split text exactly as the tokenizer will.
LLAMA3_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501 - one regular expression

SAMPLE_RELPATH = Path("data/sample/sample.jsonl")
TIKTOKEN_RELPATH = Path("tokenizer/tiktoken_test.model")
SENTENCEPIECE_RELPATH = Path("tokenizer/sentencepiece_test.model")


# ----------------------------------------------------------------------------------------------------------------
# A tiny portable random generator (SplitMix64): same numbers on every Python version and platform.

_MASK64 = (1 << 64) - 1


class Rng:
    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next64() % n

    def between(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return low + self.below(high - low + 1)

    def choice(self, items: Sequence):
        return items[self.below(len(items))]

    def chance(self, probability: float) -> bool:
        return self.next64() < int(probability * (1 << 64))

    def pick_distinct(self, items: Sequence, k: int) -> list:
        pool = list(items)
        return [pool.pop(self.below(len(pool))) for _ in range(k)]


# ----------------------------------------------------------------------------------------------------------------
# Word lists. A small, fixed vocabulary keeps the text learnable; a few accented names keep the bytes honest.

NAMES = {
    "she": [
        "Anna",
        "Mira",
        "Clara",
        "Zoë",
        "Ines",
        "Lena",
        "Ruth",
        "Maya",
        "Sofia",
        "Ada",
        "Nora",
        "Ana María",
        "Hélène",
    ],
    "he": ["Tom", "Oskar", "Felix", "José", "Samuel", "Leo", "Hugo", "Pavel", "Jonas", "Søren", "Łukasz", "Arthur"],
}
PRONOUNS = {"she": ("she", "her", "her"), "he": ("he", "him", "his")}
ADJECTIVES = [
    "small",
    "old",
    "quiet",
    "bright",
    "heavy",
    "green",
    "narrow",
    "warm",
    "cold",
    "strange",
    "gentle",
    "broken",
    "wooden",
    "silver",
    "tall",
    "patient",
    "busy",
    "empty",
    "golden",
    "dusty",
    "careful",
    "curious",
    "round",
    "soft",
]
OBJECTS = [
    "lamp",
    "key",
    "letter",
    "map",
    "basket",
    "clock",
    "book",
    "coin",
    "ribbon",
    "kettle",
    "compass",
    "bell",
    "lantern",
    "box",
    "feather",
    "painting",
    "bottle",
    "rope",
    "stone",
    "whistle",
]
PLACES = [
    "river",
    "market",
    "forest",
    "harbour",
    "library",
    "mill",
    "bridge",
    "garden",
    "station",
    "hill",
    "bakery",
    "orchard",
    "lighthouse",
    "meadow",
    "square",
    "valley",
]
DWELLINGS = ["house", "cottage", "flat", "farmhouse", "cabin", "tower"]
FURNITURE = ["table", "bed", "stairs", "window", "door", "bench", "shelf", "carpet"]
PAST_VERBS = [
    "carried",
    "opened",
    "cleaned",
    "painted",
    "repaired",
    "hid",
    "found",
    "counted",
    "wrapped",
    "measured",
    "dropped",
    "lifted",
    "studied",
    "polished",
]
ADVERBS = ["slowly", "quickly", "carefully", "quietly", "happily", "twice", "at once", "without a word"]
PARTS_OF_DAY = ["morning", "afternoon", "evening", "night"]
TIMES = ["morning", "evening", "afternoon", "night", "Sunday", "winter day", "summer evening", "rainy Tuesday"]
FEELINGS = ["happy", "tired", "surprised", "worried", "proud", "hungry", "calm", "curious"]
WEATHER = [
    ("sunny", "the sun was warm"),
    ("rainy", "the rain did not stop"),
    ("windy", "the wind shook the trees"),
    ("foggy", "the fog hid the road"),
    ("snowy", "snow covered the roofs"),
    ("cloudy", "grey clouds hung low"),
]
SAYINGS = [
    "We should go before it gets dark",
    "I have never seen anything like it",
    "Put it back where you found it",
    "Tomorrow will be a better day",
    "Let us ask the old baker",
    "It is heavier than it looks",
    "Nobody will believe us",
    "Can you hear the bell",
    "I knew you would come back",
    "Keep it safe for me",
]
ANIMALS = [
    "otter",
    "heron",
    "badger",
    "lynx",
    "tortoise",
    "beetle",
    "sparrow",
    "salamander",
    "fox",
    "hare",
    "owl",
    "seal",
    "moth",
    "trout",
    "crane",
    "marten",
]
ANIMAL_CLASSES = {
    "otter": "mammal",
    "heron": "bird",
    "badger": "mammal",
    "lynx": "mammal",
    "tortoise": "reptile",
    "beetle": "insect",
    "sparrow": "bird",
    "salamander": "amphibian",
    "fox": "mammal",
    "hare": "mammal",
    "owl": "bird",
    "seal": "mammal",
    "moth": "insect",
    "trout": "fish",
    "crane": "bird",
    "marten": "mammal",
}
HABITATS = ["wetlands", "pine forests", "rocky coasts", "grasslands", "mountain streams", "old woodlands", "deserts"]
FOODS = ["fish", "seeds", "insects", "berries", "roots", "small rodents", "leaves", "snails", "worms", "fruit"]
COUNTRIES = [
    "Veldria",
    "Osmark",
    "Talvana",
    "Brenholm",
    "Quessa",
    "Dunmore",
    "Arvelle",
    "Korrin",
    "Lusetta",
    "Marrow",
    "Pellin",
    "Sundra",
    "Tiberon",
    "Ystad",
    "Norhaven",
    "Calloway",
]
CITIES = [
    "Aberlin",
    "Corvo",
    "Deshan",
    "Elmbrook",
    "Fennick",
    "Galdor",
    "Harrowgate",
    "Istra",
    "Jorvale",
    "Kesh",
    "Lorin",
    "Mistral",
    "Nevan",
    "Orrin",
    "Pyrmont",
    "Quillon",
    "Rask",
    "Selby",
    "Torvik",
    "Ulmen",
]
INGREDIENTS = [
    ("flour", "cups"),
    ("sugar", "cups"),
    ("butter", "grams"),
    ("milk", "cups"),
    ("eggs", ""),
    ("salt", "pinches"),
    ("honey", "spoons"),
    ("apples", ""),
    ("onions", ""),
    ("carrots", ""),
    ("rice", "cups"),
    ("water", "cups"),
    ("cheese", "grams"),
    ("lemons", ""),
    ("oats", "cups"),
    ("tomatoes", ""),
]
DISHES = ["soup", "bread", "pie", "stew", "porridge", "cake", "salad", "pancakes"]
COOKING_VERBS = ["Mix", "Stir", "Pour", "Chop", "Whisk", "Fold", "Slice", "Melt"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SMALL_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
TENS_WORDS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
CLOSINGS = ["Yours sincerely", "With love", "Best wishes", "Warm regards", "See you soon"]


ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "st",
    "t",
    "th",
    "v",
    "w",
    "z",
]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk"]
TOWN_SUFFIXES = ["", "ton", "ford", "holm", "wick", "by", "mere", "dale", "stead", "ham"]
PRODUCTS = [
    "cheese",
    "wool",
    "glass",
    "clocks",
    "boats",
    "honey",
    "paper",
    "rope",
    "bells",
    "apples",
    "salt",
    "lace",
    "pottery",
    "barley",
    "timber",
    "copper",
]


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


# ----------------------------------------------------------------------------------------------------------------
# Our byte-level BPE trainer (tiktoken format). Words are pre-split with the Llama 3 pattern; pair counts are
# kept incrementally and the most frequent pair comes from a lazy max-heap, ties broken by the smaller byte pair.


def count_words(texts: Iterable[str]) -> Counter[bytes]:
    splitter = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(piece.encode("utf-8") for piece in splitter.findall(text))
    return counts


def _pairs(symbols: list[bytes]) -> Iterable[tuple[bytes, bytes]]:
    return zip(symbols, symbols[1:])


def _merge_symbols(symbols: list[bytes], left: bytes, right: bytes) -> list[bytes]:
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
            merged.append(left + right)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def train_bpe(word_counts: Counter[bytes], n_ranks: int) -> dict[bytes, int]:
    """Ranks for the 256 single bytes (rank = byte value) followed by merged tokens in the order learned."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in word] for word in sorted(word_counts)]
    freqs = [word_counts[word] for word in sorted(word_counts)]
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    pair_words: dict[tuple[bytes, bytes], set[int]] = {}
    for index, (symbols, freq) in enumerate(zip(words, freqs)):
        for pair in _pairs(symbols):
            pair_counts[pair] += freq
            pair_words.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < n_ranks and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count:
            continue  # stale entry: this pair's count changed after it was pushed
        if -negative_count < 2:
            break  # nothing left that repeats
        left, right = pair
        ranks.setdefault(left + right, len(ranks))
        changed: set[tuple[bytes, bytes]] = set()
        for index in sorted(pair_words.pop(pair)):
            old = words[index]
            new = _merge_symbols(old, left, right)
            if len(new) == len(old):
                continue  # the pair left this word through an earlier merge
            for old_pair in _pairs(old):
                pair_counts[old_pair] -= freqs[index]
                changed.add(old_pair)
            for new_pair in _pairs(new):
                pair_counts[new_pair] += freqs[index]
                pair_words.setdefault(new_pair, set()).add(index)
                changed.add(new_pair)
            words[index] = new
        for changed_pair in sorted(changed):
            count = pair_counts[changed_pair]
            if count > 0:
                heapq.heappush(heap, (-count, changed_pair))
            else:
                del pair_counts[changed_pair]
    return ranks


def tiktoken_file_bytes(ranks: dict[bytes, int]) -> bytes:
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return b"\n".join(lines) + b"\n"


# ----------------------------------------------------------------------------------------------------------------
# sentencepiece


def train_sentencepiece(documents: Sequence[str], vocab_size: int) -> bytes:
    """A byte-fallback BPE that round-trips any text: identity normalization, whitespace kept as written."""
    import sentencepiece as spm

    lines = [line for doc in documents for line in doc.split("\n") if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        minloglevel=2,
    )
    return model.getvalue()


# ----------------------------------------------------------------------------------------------------------------


def build_assets() -> dict[Path, bytes]:
    """Every asset's bytes, keyed by its path inside the assets folder (nothing is written here)."""
    documents = generate_documents(CORPUS_SEED, CORPUS_BYTES)
    corpus = "".join(jsonl_line(text) for text in documents).encode("utf-8")
    ranks = train_bpe(count_words(documents), TIKTOKEN_RANKS)
    return {
        SAMPLE_RELPATH: corpus,
        TIKTOKEN_RELPATH: tiktoken_file_bytes(ranks),
        SENTENCEPIECE_RELPATH: train_sentencepiece(documents, SENTENCEPIECE_VOCAB),
    }


def write_assets(out_dir: Path) -> dict[Path, bytes]:
    assets = build_assets()
    for relpath, data in assets.items():
        path = out_dir / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return assets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets", help="folder to write (default: ./assets)")
    args = parser.parse_args(argv)
    for relpath, data in write_assets(args.out).items():
        print(f"{args.out / relpath}: {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
