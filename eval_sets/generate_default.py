"""Generate eval_sets/default.jsonl: 300 short samples, 50 per category, from this file's own word lists.

Seeded and deterministic: the same seed gives the same bytes (a test checks that the committed file matches).
Every text here was written for this project. Answers are short so that a 135M-parameter model can attempt them.

    python eval_sets/generate_default.py            # rewrites eval_sets/default.jsonl
    python eval_sets/generate_default.py --out X.jsonl --seed 7
"""

from __future__ import annotations

import argparse
import json
import random
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

SEED = 20261129
PER_CATEGORY = 50
NEWLINE = b"\n"
OUT = Path(__file__).resolve().parent / "default.jsonl"

CAPITALS = [
    ("France", ["Paris"]), ("Germany", ["Berlin"]), ("Italy", ["Rome"]), ("Spain", ["Madrid"]),
    ("Japan", ["Tokyo"]), ("Canada", ["Ottawa"]), ("Australia", ["Canberra"]), ("Egypt", ["Cairo"]),
    ("Kenya", ["Nairobi"]), ("Brazil", ["Brasília", "Brasilia"]), ("Argentina", ["Buenos Aires"]),
    ("Peru", ["Lima"]), ("Norway", ["Oslo"]), ("Sweden", ["Stockholm"]), ("Finland", ["Helsinki"]),
    ("Poland", ["Warsaw"]), ("Greece", ["Athens"]), ("Portugal", ["Lisbon"]), ("Ireland", ["Dublin"]),
    ("Austria", ["Vienna"]), ("Hungary", ["Budapest"]), ("Turkey", ["Ankara"]), ("India", ["New Delhi"]),
    ("China", ["Beijing"]), ("South Korea", ["Seoul"]), ("Thailand", ["Bangkok"]), ("Mexico", ["Mexico City"]),
    ("Chile", ["Santiago"]), ("Cuba", ["Havana"]), ("Morocco", ["Rabat"]),
]
SCIENCE = [  # (question, references, metrics)
    ("What is the chemical symbol for gold?", ["Au"], ["exact_match"]),
    ("What is the chemical symbol for silver?", ["Ag"], ["exact_match"]),
    ("What is the chemical symbol for iron?", ["Fe"], ["exact_match"]),
    ("What is the chemical symbol for sodium?", ["Na"], ["exact_match"]),
    ("What is the chemical symbol for potassium?", ["K"], ["exact_match"]),
    ("What is the chemical symbol for helium?", ["He"], ["exact_match"]),
    ("What is the chemical symbol for copper?", ["Cu"], ["exact_match"]),
    ("Which planet is closest to the Sun?", ["Mercury"], ["exact_match", "token_f1"]),
    ("Which planet is known as the Red Planet?", ["Mars"], ["exact_match", "token_f1"]),
    ("What is the largest planet in the Solar System?", ["Jupiter"], ["exact_match", "token_f1"]),
    ("Which gas do plants take from the air for photosynthesis?", ["carbon dioxide", "CO2"], ["exact_match", "token_f1"]),
    ("What is frozen water called?", ["ice"], ["exact_match", "token_f1"]),
    ("What force pulls objects toward the ground?", ["gravity"], ["exact_match", "token_f1"]),
    ("What is the boiling point of water at sea level, in degrees Celsius?", ["100"], ["numeric_match"]),
    ("How many bones does an adult human have?", ["206"], ["numeric_match"]),
    ("How many planets are in the Solar System?", ["8"], ["numeric_match"]),
    ("What is the freezing point of water, in degrees Celsius?", ["0"], ["numeric_match"]),
    ("Which organ pumps blood through the body?", ["heart"], ["exact_match", "token_f1"]),
]
UNITS = [
    ("How many centimeters are in one meter?", 100), ("How many grams are in one kilogram?", 1000),
    ("How many seconds are in one minute?", 60), ("How many minutes are in one hour?", 60),
    ("How many hours are in one day?", 24), ("How many days are in a leap year?", 366),
    ("How many millimeters are in one centimeter?", 10), ("How many meters are in one kilometer?", 1000),
    ("How many milliliters are in one liter?", 1000), ("How many months are in a year?", 12),
    ("How many days are in a week?", 7), ("How many sides does a hexagon have?", 6),
]

SYLLABLES = ["ka", "vel", "dor", "mi", "zan", "thu", "ri", "bel", "quo", "sar", "len", "vo", "tra", "nix",
             "hal", "ou", "bren", "isk", "mor", "pel", "yth", "gar", "lo", "fen"]
ODD_SURNAMES = ["Ørnsby", "Vélez-Quist", "O'Tarran", "Müllvard", "Dąbrowin", "Søvik", "Jaćimov", "Llewarth"]
PLACE_ENDINGS = [" Harbour", "stad", " Falls", "by", " Crossing", "mouth", " Station", " Ridge"]
ORGS = ["river authority", "botanical society", "chess federation", "harbour board", "weather office",
        "choir", "library trust", "rowing club"]
REAL_PEOPLE = [
    ("Who wrote the play Romeo and Juliet?", ["William Shakespeare", "Shakespeare"]),
    ("Who painted the Mona Lisa?", ["Leonardo da Vinci", "da Vinci"]),
    ("Who developed the theory of relativity?", ["Albert Einstein", "Einstein"]),
    ("Who was the first person to walk on the Moon?", ["Neil Armstrong", "Armstrong"]),
    ("Who proposed evolution by natural selection in On the Origin of Species?", ["Charles Darwin", "Darwin"]),
    ("Who discovered penicillin in 1928?", ["Alexander Fleming", "Fleming"]),
    ("Who wrote the novel Pride and Prejudice?", ["Jane Austen", "Austen"]),
    ("Who was the first President of the United States?", ["George Washington", "Washington"]),
    ("Who formulated the three laws of motion?", ["Isaac Newton", "Newton"]),
    ("Who won Nobel Prizes in both physics and chemistry?", ["Marie Curie", "Curie"]),
    ("Who wrote the novel Don Quixote?", ["Miguel de Cervantes", "Cervantes"]),
    ("Who composed the opera The Magic Flute?", ["Wolfgang Amadeus Mozart", "Mozart"]),
]

LANGUAGES = ["French", "German", "Spanish", "Chinese", "Japanese"]
PHRASES = {  # English -> (French, German, Spanish, Chinese, Japanese)
    "Good morning.": ("Bonjour.", "Guten Morgen.", "Buenos días.", "早上好。", "おはようございます。"),
    "Thank you very much.": ("Merci beaucoup.", "Vielen Dank.", "Muchas gracias.", "非常感谢。", "どうもありがとうございます。"),
    "The cat is black.": ("Le chat est noir.", "Die Katze ist schwarz.", "El gato es negro.", "猫是黑色的。", "猫は黒いです。"),
    "I like apples.": ("J'aime les pommes.", "Ich mag Äpfel.", "Me gustan las manzanas.", "我喜欢苹果。", "私はりんごが好きです。"),
    "Where is the train station?": ("Où est la gare ?", "Wo ist der Bahnhof?", "¿Dónde está la estación de tren?",
                                    "火车站在哪里？", "駅はどこですか？"),
    "The weather is nice today.": ("Il fait beau aujourd'hui.", "Das Wetter ist heute schön.", "Hace buen tiempo hoy.",
                                   "今天天气很好。", "今日はいい天気です。"),
    "My name is Anna.": ("Je m'appelle Anna.", "Ich heiße Anna.", "Me llamo Anna.", "我叫安娜。", "私の名前はアンナです。"),
    "The water is cold.": ("L'eau est froide.", "Das Wasser ist kalt.", "El agua está fría.", "水很冷。", "水は冷たいです。"),
    "I have two brothers.": ("J'ai deux frères.", "Ich habe zwei Brüder.", "Tengo dos hermanos.", "我有两个兄弟。",
                             "私には兄弟が二人います。"),
    "The book is on the table.": ("Le livre est sur la table.", "Das Buch liegt auf dem Tisch.",
                                  "El libro está sobre la mesa.", "书在桌子上。", "本はテーブルの上にあります。"),
}
LOCAL_QUESTIONS = [  # questions asked and answered in the language
    ("Quelle est la capitale de l'Italie ? Réponds en un seul mot.", ["Rome"]),
    ("Combien font deux plus trois ? Réponds en toutes lettres, en un mot.", ["cinq"]),
    ("Was ist die Hauptstadt von Deutschland? Antworte mit einem Wort.", ["Berlin"]),
    ("Welche Farbe hat der Himmel an einem klaren Tag? Antworte mit einem Wort.", ["Blau"]),
    ("¿Cuál es la capital de España? Responde con una sola palabra.", ["Madrid"]),
    ("¿Cuántos días tiene una semana? Responde con el número en letras.", ["siete"]),
    ("中国的首都是哪座城市？只回答城市名。", ["北京"]),
    ("一年有几个月？请用汉字回答。", ["十二个月", "十二"]),
    ("日本の首都はどこですか？都市名だけで答えてください。", ["東京"]),
    ("一週間は何日ですか？漢字で答えてください。", ["七日"]),
]

CHOICES = [  # (question, right answer, three wrong answers)
    ("Which animal is a mammal?", "dolphin", ["shark", "trout", "octopus"]),
    ("Which of these is a fruit?", "apple", ["carrot", "potato", "onion"]),
    ("Which number is even?", "14", ["7", "9", "21"]),
    ("Which is the largest ocean?", "Pacific", ["Atlantic", "Indian", "Arctic"]),
    ("Which is a programming language?", "Python", ["Everest", "Danube", "Sahara"]),
    ("What do bees make?", "honey", ["milk", "wool", "paper"]),
    ("Which metal is liquid at room temperature?", "mercury", ["iron", "copper", "aluminium"]),
    ("Which shape has three sides?", "triangle", ["square", "circle", "pentagon"]),
    ("Which month has the fewest days?", "February", ["March", "July", "October"]),
    ("At what temperature does water freeze?", "0 degrees Celsius", ["10 degrees Celsius", "50 degrees Celsius", "100 degrees Celsius"]),
    ("Which continent is Egypt in?", "Africa", ["Europe", "South America", "Australia"]),
    ("Which gas do humans need to breathe?", "oxygen", ["helium", "neon", "argon"]),
    ("Which of these is a vegetable?", "carrot", ["banana", "cherry", "grape"]),
    ("Which is a unit of length?", "meter", ["kilogram", "second", "liter"]),
    ("How many legs does an insect have?", "six", ["four", "eight", "ten"]),
    ("Which language is mainly spoken in Brazil?", "Portuguese", ["Spanish", "French", "Italian"]),
    ("What is the opposite of hot?", "cold", ["warm", "big", "fast"]),
    ("Which tool cuts paper?", "scissors", ["spoon", "pillow", "bucket"]),
    ("Which season comes after winter?", "spring", ["summer", "autumn", "midnight"]),
    ("Which of these can fly?", "eagle", ["horse", "whale", "snail"]),
]
ONE_WORD = [
    ("What color is a ripe banana?", "yellow"), ("Which animal says moo?", "cow"),
    ("What is a baby dog called?", "puppy"), ("What is the opposite of up?", "down"),
    ("What color is fresh grass?", "green"), ("What color is snow?", "white"),
    ("Which day comes after Monday?", "Tuesday"), ("What is the plural of mouse?", "mice"),
    ("What is the opposite of open?", "closed"), ("Which animal barks?", "dog"),
    ("What color is the sky on a clear day?", "blue"), ("What do you call frozen rain?", "hail"),
    ("Which month comes after June?", "July"), ("What is the opposite of night?", "day"),
    ("How many is a dozen, written as a word?", "twelve"), ("Which body part do you hear with?", "ear"),
]
JSON_PAIRS = [("city", ["Paris", "Lima", "Oslo", "Cairo"]), ("color", ["red", "blue", "green"]),
              ("animal", ["cat", "horse", "owl"]), ("fruit", ["pear", "mango", "plum"]), ("name", ["Ada", "Bruno", "Chen"])]

TOWNS = ["Brindlemoor", "Ashcombe", "Kelvarra", "Dunhollow", "Pellingford", "Marrowick", "Thistlebay", "Corvane"]
FACILITIES = ["library", "swimming pool", "bridge", "school", "bus station", "concert hall"]
MONTHS = ["March", "April", "May", "June", "September", "October"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
COMPANIES = ["Norvetta", "Quillon Labs", "Halvard Systems", "Brightmere", "Ostrava Tech", "Lumaris"]
PRODUCTS = ["folding phone", "solar charger", "smart watch", "electric scooter", "home robot", "tablet"]
WEATHER = ["snow", "rain", "wind", "fog"]
TEAMS = ["Harbour Lions", "Valley Hawks", "River Foxes", "Northgate Bears", "Hill Wolves", "Coast Eagles"]
ANIMALS = ["frog", "beetle", "lizard", "spider", "snail", "moth"]
PLACES = ["the Andes", "Borneo", "Madagascar", "the Alps", "New Guinea", "Patagonia"]
UNIS = ["Kelvarra University", "the Marrowick Institute", "Dunhollow College", "the Ashcombe Museum"]


def _words(n: int) -> str:
    """English words for 0 <= n < 1,000,000 (used for digit-writing questions)."""
    ones = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " \
           "sixteen seventeen eighteen nineteen".split()
    tens = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()

    def below_1000(k: int) -> list[str]:
        out = []
        if k >= 100:
            out += [ones[k // 100], "hundred"]
            k %= 100
        if k >= 20:
            out.append(tens[k // 10] + (f"-{ones[k % 10]}" if k % 10 else ""))
        elif k or not out:
            out.append(ones[k])
        return out

    if n < 1000:
        return " ".join(below_1000(n))
    rest = below_1000(n % 1000) if n % 1000 else []
    return " ".join(below_1000(n // 1000) + ["thousand"] + rest)


def _row(id_, category, prompt, references, metrics, **extra) -> dict:
    if "exact_match" in metrics:  # small models answer in a sentence: also score "answer contained"
        metrics = [*metrics, "contains"]
    return {"id": id_, "category": category, "prompt": prompt, "references": references, "metrics": metrics, **extra}


def factual(rng: random.Random) -> list[dict]:
    caps = rng.sample(CAPITALS, 22)
    rows = [(f"What is the capital of {c}? Answer with the city name only.", refs, ["exact_match", "token_f1"])
            for c, refs in caps]
    rows += [(f"{q} Answer as briefly as possible.", refs, m) for q, refs, m in rng.sample(SCIENCE, 16)]
    rows += [(f"{q} Answer with a number only.", [str(v)], ["numeric_match"]) for q, v in rng.sample(UNITS, 12)]
    return [_row(f"fact-{i:03d}", "factual_qa", *r) for i, r in enumerate(rows, 1)]


def _unique(make, n: int, seen: set[str]) -> list[tuple[str, str]]:
    """n (question, answer) pairs from `make()` whose questions are not in `seen` (which grows)."""
    out: list[tuple[str, str]] = []
    while len(out) < n:
        q, a = make()
        if q not in seen:
            seen.add(q)
            out.append((q, a))
    return out


def arithmetic(rng: random.Random) -> list[dict]:
    r = rng.randint

    def add():
        a, b = r(10, 999), r(10, 999)
        return f"What is {a} + {b}?", str(a + b)

    def sub():
        a, b = r(10, 500), r(10, 500)
        return f"What is {a} - {b}?", str(a - b)

    def mul():
        a, b = r(2, 30), r(2, 30)
        return f"What is {a} times {b}?", str(a * b)

    def div():
        b, q = r(2, 12), r(2, 25)
        return f"What is {b * q} divided by {b}?", str(q)

    def percent():
        p, n = rng.choice([10, 20, 25, 50, 75]), r(1, 40) * 20
        return f"What is {p}% of {n}?", str(p * n // 100)

    def digits():
        n = r(1001, 99999)
        return f"Write the number {_words(n)} in digits.", str(n)

    def rounding():
        x = Decimal(f"{r(0, 99)}.{r(0, 99):02d}{rng.choice([1, 2, 3, 4, 6, 7, 8, 9])}")
        return f"Round {x} to two decimal places.", str(x.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))

    seen: set[str] = set()
    qa = [pair for make, n in ((add, 12), (sub, 10), (mul, 10), (div, 6), (percent, 6), (digits, 3), (rounding, 3))
          for pair in _unique(make, n, seen)]
    return [_row(f"num-{i:03d}", "arithmetic_numbers", f"{q} Answer with the number only.", [a], ["numeric_match"])
            for i, (q, a) in enumerate(qa, 1)]


def _invented(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def proper_nouns(rng: random.Random) -> list[dict]:
    seen: set[str] = set()

    def person() -> str:
        while True:
            last = rng.choice(ODD_SURNAMES) if rng.random() < 0.3 else _invented(rng, 3)
            name = f"{_invented(rng, 2)} {last}"
            if name not in seen:
                seen.add(name)
                return name

    def place() -> str:
        while True:
            name = _invented(rng, 2) + rng.choice(PLACE_ENDINGS)
            if name not in seen:
                seen.add(name)
                return name

    qa: list[tuple[str, list[str]]] = []
    for _ in range(15):
        n = person()
        qa.append((f"Repeat this name exactly, with nothing else: {n}", [n]))
    for _ in range(15):
        n, org = person(), rng.choice(ORGS)
        qa.append((f"{n} was chosen to lead the {org} last spring. Who was chosen? Answer with the full name only.", [n]))
    for _ in range(10):
        a, b = place(), place()
        qa.append((f"The ferry from {a} to {b} leaves at noon. Where does the ferry leave from? "
                   "Answer with the place name only.", [a]))
    qa += [(f"{q} Answer with the full name only.", refs) for q, refs in rng.sample(REAL_PEOPLE, 10)]
    return [_row(f"name-{i:03d}", "proper_nouns", q, refs, ["exact_match", "token_f1"])
            for i, (q, refs) in enumerate(qa, 1)]


def multilingual(rng: random.Random) -> list[dict]:
    rows = []
    for li, lang in enumerate(LANGUAGES):
        for en in rng.sample(sorted(PHRASES), 8):
            rows.append((f"Translate into {lang}. Reply with the translation only: {en}", [PHRASES[en][li]],
                         ["chrf", "bleu"]))
    rows += [(q, refs, ["chrf", "exact_match"]) for q, refs in LOCAL_QUESTIONS]
    return [_row(f"lang-{i:03d}", "multilingual", *r) for i, r in enumerate(rows, 1)]


def instruction_format(rng: random.Random) -> list[dict]:
    rows = []
    for q, right, wrong in CHOICES:
        options = [right, *wrong]
        rng.shuffle(options)
        lines = "\n".join(f"{'ABCD'[k]}) {o}" for k, o in enumerate(options))
        rows.append((f"{q}\n{lines}\nAnswer with the letter only.", ["ABCD"[options.index(right)]], ["choice_accuracy"]))
    for q, a in rng.sample(ONE_WORD, 15):
        rows.append((f"Answer with exactly one word. {q}", [a], ["exact_match"]))
    for key, value in rng.sample([(k, v) for k, vs in JSON_PAIRS for v in vs], 10):
        rows.append((f'Output only a JSON object whose key "{key}" has the string value "{value}".',
                     [json.dumps({key: value})], ["exact_match", "token_f1"]))
    for n in rng.sample(range(3, 10), 5):
        rows.append((f"Output only a JSON array of the whole numbers from 1 to {n}.", [json.dumps(list(range(1, n + 1)))],
                     ["exact_match", "token_f1"]))
    return [_row(f"fmt-{i:03d}", "instruction_format", *r) for i, r in enumerate(rows, 1)]


def summarization(rng: random.Random) -> list[dict]:
    c = rng.choice

    def council():
        t, f, m = c(TOWNS), c(FACILITIES), c(MONTHS)
        return (f"The {t} council voted on {c(DAYS)} to build a new {f}. Work starts in {m} and will cost "
                f"{rng.randint(2, 40)} million euros. Residents have asked for it for years.",
                f"The {t} council voted to build a new {f}, with work starting in {m}.")

    def launch():
        co, p, m, price = c(COMPANIES), c(PRODUCTS), c(MONTHS), rng.randint(2, 19) * 50
        return (f"{co} presented a new {p} on {c(DAYS)}. It will cost {price} dollars and goes on sale in {m}. "
                "Early reviews praised its battery life.",
                f"{co} presented a new {p} that costs {price} dollars and goes on sale in {m}.")

    def storm():
        t, w, n = c(TOWNS), c(WEATHER), rng.randint(3, 30)
        return (f"Heavy {w} hit {t} on {c(DAYS)} and closed {n} schools. Officials expect it to ease by the "
                "weekend. People were asked to stay at home.",
                f"Heavy {w} closed {n} schools in {t}.")

    def match():
        a, b = rng.sample(TEAMS, 2)
        s2 = rng.randint(0, 3)
        s1 = s2 + rng.randint(1, 3)
        return (f"The {a} beat the {b} {s1} to {s2} on {c(DAYS)}. Their captain scored twice after the break. "
                f"The win puts the {a} top of the league.",
                f"The {a} beat the {b} {s1} to {s2} and now lead the league.")

    def species():
        u, a, p = c(UNIS), c(ANIMALS), c(PLACES)
        return (f"Researchers from {u} found a new species of {a} in {p}. It is about {rng.randint(2, 9)} "
                f"centimeters long. The team named it after a local teacher.",
                f"Researchers from {u} found a new {a} species in {p}.")

    makers = [council, launch, storm, match, species]
    rows, seen = [], set()
    while len(rows) < PER_CATEGORY:
        passage, ref = makers[len(rows) % len(makers)]()
        if passage in seen:
            continue
        seen.add(passage)
        rows.append(_row(f"sum-{len(rows) + 1:03d}", "summarization", f"Summarize in one sentence:\n{passage}", [ref],
                         ["rouge_l"], max_tokens=64,
                         criteria="One sentence that keeps the main event and its key fact, with nothing invented."))
    return rows


def generate(seed: int = SEED) -> list[dict]:
    rows = []
    for make in (factual, arithmetic, proper_nouns, multilingual, instruction_format, summarization):
        part = make(random.Random(f"{seed}-{make.__name__}"))  # one stream per category: editing one leaves the rest
        assert len(part) == PER_CATEGORY, (make.__name__, len(part))
        rows += part
    return rows


def render(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    data = render(generate(args.seed))
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes, {data.count(NEWLINE)} samples)")


if __name__ == "__main__":
    main()
