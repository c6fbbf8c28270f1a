"""Generates the bundled raw sample under data_pipeline/sample/ (deterministic; < 3 MB):

    text/web/*.jsonl              encyclopedia-style documents about invented towns, with planted
                                  exact duplicates, near duplicates (Jaccard 0.8-0.9), junk for
                                  every quality rule and malformed / non-UTF-8 / empty records
    text/knowledge/*.parquet      definitions of invented animals (the rephrasing source)
    images/wds/*.tar              WebDataset shards of rendered shape scenes with captions
                                  ("a large red circle at the top left"), one broken shard
    images/folder/*.png + .txt    more scenes, an image-folder source
    video/frames/<id>/            frame folders of a moving shape + caption.txt
    video/gif/*.gif + .txt        the same kind of clips as animated GIFs
    chat/*.jsonl, chat/images/    conversations for fine-tuning (configs/data/chat_sample.yaml):
                                  questions about the invented towns and animals, tool calls
                                  (lookup_town, add), questions about shape scenes (one or two
                                  pictures), planted duplicates and broken records
    tasks/tasks.jsonl             RL tasks (train/posttrain/tasks.py): arithmetic ("What is
                                  7 + 5?", three-digit ones with the calculator tool), questions
                                  about the letters of an invented word (reverse, capitals,
                                  first, last, count) and tiny Python functions with their tests
                                  and reference solution ("solution"). Budgets by effort: low 8
                                  tokens (one-digit sums and differences, first and last
                                  letters), medium 16 (two-digit ones, capitals, counts), high
                                  32 (reversal), max 64 (a calculator call, a function)
    tasks/sft.jsonl               conversations showing the same kinds of tasks on other prompts
                                  (configs/data/tasks_sft.yaml), answered as the verifiers accept
                                  ("12"; code in a ```python block), calculator calls included
    planted.json                  every planted record with what the pipeline must do with it
                                  (the chat source's under "chat")

Run `python -m data_pipeline.make_sample` to regenerate; the output is byte-identical.
"""

from __future__ import annotations

import argparse
import io
import json
import operator
import random
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from .config import SAMPLE_DIR, DataConfig
from .conversations import chat_text, image_parts, picture_digest
from .dedup import jaccard, word_shingles
from .imaging import perceptual_signature
from .tool_schemas import CALCULATE

SEED = 20260
CANVAS = 112

# ---------------------------------------------------------------- text

_SYL = ["va", "lor", "mi", "ten", "ka", "dru", "sel", "or", "bre", "nis", "ta", "quen", "hol",
        "ri", "mar", "en", "zu", "fal", "do", "wyn", "ast", "el", "gor", "pa", "thi", "lun"]
_DIRECTIONS = ["northern", "southern", "eastern", "western"]
_GOODS = ["wool", "salt", "copper", "honey", "amber", "timber", "glass", "cheese", "linen",
          "pottery", "barley", "olive oil", "dried fish", "leather", "iron tools", "silver"]
_TRADES = ["weavers", "potters", "fishermen", "smiths", "millers", "brewers", "carpenters",
           "glassblowers", "shepherds", "masons"]
_LANDMARKS = ["a stone bridge", "an old watchtower", "a covered market", "a round chapel",
              "a tall lighthouse", "a walled garden", "a wooden mill", "a public bath",
              "a library of maps", "a clock tower"]
_FESTIVALS = ["a lantern festival", "a harvest fair", "a boat race", "a music contest",
              "a spring market", "a winter feast"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_TERRAIN = ["rolling hills", "a wide marsh", "pine forests", "chalk cliffs", "a quiet lake",
            "terraced vineyards", "a rocky coast", "open meadows"]

_TOWN_SENTENCES = [
    "The town of {name} lies on the {dir} bank of the river {river}.",
    "It was founded in the year {year} by a group of {trade} from the coast.",
    "Most of its {pop} inhabitants work as {trade2} or trade in {good}.",
    "The market of {name} is famous for its {good} and its {good2}.",
    "Visitors often come to see {landmark}, which was built about {age} years ago.",
    "Every {season} the people of {name} hold {festival} that lasts for {days} days.",
    "The land around the town is covered with {terrain} and small farms.",
    "A road connects {name} with the larger city of {city}, about {dist} miles away.",
    "In the old days the town paid its taxes in {good} instead of coins.",
    "The local council meets in a hall next to {landmark}.",
    "Children in {name} learn to swim in the river before they can read.",
    "Travellers say that the bread of {name} is the best in the whole valley.",
    "During a flood in {year2} the lower streets were under water for a week.",
    "The climate is mild, although the winds from the {dir2} can be strong in {season2}.",
    "Many houses have red roofs and walls painted in bright colours.",
    "The town has a small school, two inns and a harbour for river boats.",
]
_ANIMAL_SENTENCES = [
    "The {name} is a {size} animal that lives in {habitat}.",
    "It has {cover} and a {tail} tail that helps it keep its balance.",
    "The {name} feeds mainly on {food}, which it finds {when}.",
    "Females lay between {eggs} and {eggs2} eggs in a nest hidden among {hiding}.",
    "Young animals stay with their mother for about {months} months.",
    "Scientists first described the {name} in the year {year}.",
    "Its call sounds like {sound} and can be heard over long distances.",
    "The {name} is not dangerous to people, but it defends its nest with great courage.",
    "Farmers like the {name} because it eats insects that harm the crops.",
    "In cold months the {name} grows thicker {cover2} and sleeps for long hours.",
    "An adult weighs about {weight} kilograms and lives for up to {life} years.",
    "The {name} is closely related to the {relative}, but it is larger and slower.",
]
_ANIMAL_SLOTS = {
    "size": ["small", "large", "slender", "stocky", "tiny", "heavy"],
    "habitat": ["dry grasslands", "mountain forests", "river valleys", "coastal dunes",
                "old orchards", "high plateaus", "swampy lowlands"],
    "cover": ["soft grey fur", "spotted brown feathers", "thin green scales", "striped fur",
              "short golden hair", "dark glossy feathers"],
    "cover2": ["fur", "feathers", "down"],
    "tail": ["long", "short", "bushy", "flat", "curled"],
    "food": ["seeds and berries", "small fish", "beetles and worms", "roots and bark",
             "fallen fruit", "snails"],
    "when": ["at dawn", "after rain", "under fallen leaves", "near the water", "at night"],
    "hiding": ["tall reeds", "rocks", "tree roots", "thorny bushes", "dry grass"],
    "sound": ["a short whistle", "a low drum", "a creaking door", "two soft bells",
              "a sharp click"],
    "relative": ["marsh hare", "stone owl", "river otter", "field lark", "hill goat"],
}


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(_SYL) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in used:
            used.add(name)
            return name


def _fill(template: str, slots: dict) -> str:
    return template.format(**slots)


def town_document(rng: random.Random, used: set[str]) -> str:
    return town_facts(rng, used)[1]


def town_facts(rng: random.Random, used: set[str]) -> tuple[dict, str]:
    """(slots, document) of an invented town."""
    name = _name(rng, used)
    slots = {"name": name, "river": _name(rng, used), "city": _name(rng, used),
             "dir": rng.choice(_DIRECTIONS), "dir2": rng.choice(_DIRECTIONS),
             "year": rng.randint(900, 1700), "year2": rng.randint(1700, 1990),
             "trade": rng.choice(_TRADES), "trade2": rng.choice(_TRADES),
             "pop": rng.randint(800, 40000), "good": rng.choice(_GOODS),
             "good2": rng.choice(_GOODS), "landmark": rng.choice(_LANDMARKS),
             "age": rng.randint(60, 700), "season": rng.choice(_SEASONS),
             "season2": rng.choice(_SEASONS), "festival": rng.choice(_FESTIVALS),
             "days": rng.randint(2, 9), "terrain": rng.choice(_TERRAIN),
             "dist": rng.randint(5, 120)}
    first, rest = _TOWN_SENTENCES[0], _TOWN_SENTENCES[1:]
    picked = [first] + rng.sample(rest, rng.randint(6, 11))
    sentences = [_fill(t, slots) for t in picked]
    cut = rng.randint(3, len(sentences) - 2)
    return slots, " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:])


def animal_document(rng: random.Random, used: set[str]) -> str:
    return animal_facts(rng, used)[1]


def animal_facts(rng: random.Random, used: set[str]) -> tuple[dict, str]:
    """(slots, document) of an invented animal."""
    slots = {k: rng.choice(v) for k, v in _ANIMAL_SLOTS.items()}
    slots.update(name=_name(rng, used).lower(), eggs=rng.randint(2, 4), eggs2=rng.randint(5, 9),
                 months=rng.randint(2, 14), year=rng.randint(1750, 2010),
                 weight=rng.randint(1, 90), life=rng.randint(3, 40))
    picked = [_ANIMAL_SENTENCES[0]] + rng.sample(_ANIMAL_SENTENCES[1:], rng.randint(6, 10))
    return slots, " ".join(_fill(t, slots) for t in picked)


def _near_duplicate(rng: random.Random, text: str, ngram: int) -> tuple[str, float]:
    """Replace random words while the Jaccard similarity stays above a random target in
    [0.8, 0.9]."""
    target = rng.uniform(0.8, 0.9)
    original = word_shingles(text, ngram)
    words = text.split(" ")
    best_j, misses = 1.0, 0
    while misses < 30:
        i = rng.randrange(len(words))
        old, words[i] = words[i], rng.choice(["quite", "also", "very", "often", "still"])
        j = jaccard(original, word_shingles(" ".join(words), ngram))
        if target <= j < best_j:
            best_j, misses = j, 0
        else:
            words[i], misses = old, misses + 1
    assert 0.8 <= best_j < 1.0, best_j
    return " ".join(words), best_j


def _junk(rng: random.Random) -> list[tuple[str, str]]:
    """(text, ledger stage expected to drop it)."""
    gibberish = " ".join("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(5))
                         for _ in range(80))
    lines = "\n".join(f"- item {i} ..." for i in range(40))
    return [
        ("Click here to subscribe.", "filter_text_length"),
        ("Buy now! Best prices.", "filter_text_length"),
        (" ".join(["#$%&*@!"] * 60), "filter_gopher_quality"),
        (gibberish, "filter_gopher_quality"),
        ("\n".join("\u2022 cheap flights and hotels" for _ in range(40)), "filter_gopher_quality"),
        (lines, "filter_gopher_quality"),
        (" ".join(["Pneumonoultramicroscopicsilicovolcanoconiosis"] * 12),
         "filter_gopher_quality"),
        ("\n".join(["The offer is valid for all members of the club and their families."] * 30),
         "filter_gopher_repetition"),
        ("\n\n".join(["Sign up with your email to get the newsletter of the week and the best "
                      "deals of the month in your inbox."] * 12), "filter_gopher_repetition"),
    ]


# ---------------------------------------------------------------- pictures

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
          "yellow": (240, 200, 30), "purple": (150, 60, 190), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 14, "large": 26}
POSITIONS = {"top left": (28, 28), "top": (56, 28), "top right": (84, 28), "left": (28, 56),
             "center": (56, 56), "right": (84, 56), "bottom left": (28, 84),
             "bottom": (56, 84), "bottom right": (84, 84)}


def _draw(draw: ImageDraw.ImageDraw, shape: str, color, center, radius: int) -> None:
    x, y = center
    box = (x - radius, y - radius, x + radius, y + radius)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(x, y - radius), (x - radius, y + radius), (x + radius, y + radius)],
                     fill=color)


def _scene(objects) -> Image.Image:
    img = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for shape, color, size, position in objects:
        _draw(draw, shape, COLORS[color], POSITIONS[position], SIZES[size])
    return img


def _caption(objects) -> str:
    parts = []
    for shape, color, size, position in objects:
        where = f"in the {position}" if position == "center" else (
            f"on the {position}" if position in ("left", "right") else f"at the {position}")
        parts.append(f"a {size} {color} {shape} {where}")
    return " and ".join(parts)


def _scenes(rng: random.Random, count: int):
    """Distinct scene descriptions: one shape anywhere, or two shapes left and right."""
    singles = [((s, c, z, p),) for s in SHAPES for c in COLORS for z in SIZES for p in POSITIONS]
    pairs = [((s1, c1, "small", "left"), (s2, c2, "small", "right"))
             for s1 in SHAPES for s2 in SHAPES for c1 in COLORS for c2 in COLORS if c1 != c2]
    pool = rng.sample(singles, count // 2) + rng.sample(pairs, count - count // 2)
    rng.shuffle(pool)
    return pool


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=9)
    return buf.getvalue()


def _jpeg_roundtrip(img: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _brighter(img: Image.Image, delta: int) -> Image.Image:
    return img.point(lambda v: min(255, v + delta))


def _clip(shape: str, color: str, direction: str, frames: int) -> list[Image.Image]:
    start, end = {"right": ((20, 56), (92, 56)), "left": ((92, 56), (20, 56)),
                  "down": ((56, 20), (56, 92)), "up": ((56, 92), (56, 20))}[direction]
    out = []
    for i in range(frames):
        x = round(start[0] + (end[0] - start[0]) * i / (frames - 1))
        y = round(start[1] + (end[1] - start[1]) * i / (frames - 1))
        img = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
        _draw(ImageDraw.Draw(img), shape, COLORS[color], (x, y), 16)
        out.append(img)
    return out


def _gif(frames: list[Image.Image]) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100,
                   loop=0)
    return buf.getvalue()


def _same_signature(a, b, cfg) -> bool:
    """The dedup rule (dedup.py) on two perceptual signatures."""
    color = int(abs(a[1].astype(int) - b[1].astype(int)).max())
    return (a[0] ^ b[0]).bit_count() <= cfg.phash_max_distance and color <= cfg.color_max_difference


def _same_picture(a: Image.Image, b: Image.Image, cfg) -> bool:
    return _same_signature(perceptual_signature(a), perceptual_signature(b), cfg)


# ---------------------------------------------------------------- writer

class Sample:
    """Collects files and the planted truth."""

    def __init__(self, root: Path):
        self.root = root
        self.planted: dict[str, list | dict] = {k: [] for k in (
            "distinct_text", "exact_duplicates", "near_duplicates", "junk", "quarantine",
            "image_duplicates", "video_duplicates", "filtered_images", "special_text")}
        self.towns: list[dict] = []  # the invented facts, for the chat sample's questions
        self.animals: list[dict] = []

    def write(self, rel: str, data: bytes | str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _jsonl(records: list) -> bytes:
    """records: dicts (JSON-encoded) or raw bytes lines (written as they are)."""
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode("utf-8")) + b"\n"
                    for r in records)


def build_text(sample: Sample, rng: random.Random, cfg: DataConfig) -> None:
    used: set[str] = set()
    ngram = cfg.dedup.ngram
    facts = [town_facts(rng, used) for _ in range(560)]
    sample.towns = [slots for slots, _ in facts]
    towns = [text for _, text in facts]
    files: list[list] = [[], [], []]
    ids: list[list[str]] = [[], [], []]

    def add(file: int, record) -> str:
        files[file].append(record)
        rid = f"web/web_{file:03d}.jsonl#{len(files[file]) - 1}"
        ids[file].append(rid)
        return rid

    originals = []
    for i, text in enumerate(towns):
        rid = add(i % 2, {"id": f"town-{i}", "text": text})
        sample.planted["distinct_text"].append(rid)
        originals.append((rid, text))
    # later file: exact duplicates (case / whitespace variants), near duplicates, junk, bad records
    for k, (rid, text) in enumerate(rng.sample(originals, 40)):
        variant = [text, text.lower(), "  " + text.replace(" ", "   ") + "\n"][k % 3]
        dup = add(2, {"id": f"copy-{k}", "text": variant})
        sample.planted["exact_duplicates"].append({"id": dup, "of": rid})
    for k, (rid, text) in enumerate(rng.sample(originals, 60)):
        near, j = _near_duplicate(rng, text, ngram)
        dup = add(2, {"id": f"near-{k}", "text": near})
        sample.planted["near_duplicates"].append({"id": dup, "of": rid, "jaccard": round(j, 4)})
    for k, (text, stage) in enumerate(_junk(rng)):
        sample.planted["junk"].append({"id": add(2, {"id": f"junk-{k}", "text": text}),
                                       "stage": stage})
    special = ("Web pages sometimes contain the literal tag <image> or <video> inside the text. "
               "Such strings are ordinary words for the tokenizer and must never become "
               "placeholders for pictures. The same holds for <eod> and <pad>, which only the "
               "pipeline itself may insert between documents when it packs them into rows.")
    sample.planted["special_text"].append(add(2, {"id": "special", "text": special}))
    bad = [
        (b'{"id": "broken", "text": "this line never ends', "malformed_json"),
        (b'[1, 2, 3]', "malformed_json"),
        (b'{"id": "latin1", "text": "caf\xe9 cr\xe8me br\xfbl\xe9e"}', "non_utf8"),
        (b'{"id": "surrogate", "text": "lone \\ud800 surrogate"}', "non_utf8"),
        (b'{"id": "empty", "text": ""}', "empty_document"),
        (b'{"id": "blank", "text": "   \\n  "}', "empty_document"),
        (b'{"id": "notext", "body": "the text is under another key"}', "missing_text"),
        (b'{"id": "number", "text": 42}', "missing_text"),
    ]
    for raw, reason in bad:
        sample.planted["quarantine"].append({"id": add(2, raw), "reason": reason})
    for f in range(3):
        sample.write(f"text/web/web_{f:03d}.jsonl", _jsonl(files[f]))
    # knowledge: parquet, with one exact copy of a web document (the web copy is kept)
    import pyarrow as pa
    import pyarrow.parquet as pq

    facts = [animal_facts(rng, used) for _ in range(150)]
    sample.animals = [slots for slots, _ in facts]
    animals = [text for _, text in facts]
    texts: list[str | None] = list(animals)
    for rid, text in rng.sample(originals, 3):
        texts.append(text)
        sample.planted["exact_duplicates"].append(
            {"id": f"knowledge/knowledge_000.parquet#{len(texts) - 1}", "of": rid})
    texts += [None, ""]
    for i, reason in ((len(texts) - 2, "missing_text"), (len(texts) - 1, "empty_document")):
        sample.planted["quarantine"].append({"id": f"knowledge/knowledge_000.parquet#{i}",
                                             "reason": reason})
    sample.planted["distinct_text"] += [f"knowledge/knowledge_000.parquet#{i}"
                                        for i in range(len(animals))]
    table = pa.table({"id": [f"animal-{i}" for i in range(len(texts))], "text": texts})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    sample.write("text/knowledge/knowledge_000.parquet", buf.getvalue())


def build_images(sample: Sample, rng: random.Random, cfg: DataConfig) -> None:
    scenes = _scenes(rng, 360)
    pictures = [_scene(s) for s in scenes]
    signatures = [perceptual_signature(p) for p in pictures]
    for i in range(len(pictures)):  # the planted truth: distinct scenes are not duplicates
        for j in range(i):
            assert not _same_signature(signatures[i], signatures[j], cfg.dedup), \
                (scenes[i], scenes[j])
    wds = [[], []]
    wds_ids = []
    for i, (scene, img) in enumerate(zip(scenes[:260], pictures[:260])):
        key = f"scene{i:04d}"
        wds[i % 2] += [(f"{key}.png", _png(img)), (f"{key}.txt", _caption(scene).encode())]
        wds_ids.append(f"shapes/shapes_{i % 2:03d}.tar#{key}")
    # planted: near copies (JPEG, brighter) and an exact copy under other keys and captions
    for k, (i, make) in enumerate([(3, _jpeg_roundtrip), (8, lambda im: _brighter(im, 8)),
                                   (13, lambda im: im.copy())]):
        img = make(pictures[i])
        assert _same_picture(img, pictures[i], cfg.dedup)
        key = f"copy{k:04d}"
        wds[1] += [(f"{key}.png", _png(img)), (f"{key}.txt", b"a picture of some shapes")]
        sample.planted["image_duplicates"].append({"id": f"shapes/shapes_001.tar#{key}",
                                                   "of": wds_ids[i]})
    # planted bad samples and geometry junk
    truncated = _png(pictures[0])[:200]
    wds[0] += [("trunc0000.png", truncated), ("trunc0000.txt", b"a truncated picture"),
               ("nocap0000.png", _png(pictures[1])),
               ("noimg0000.txt", b"a caption without a picture"),
               ("garbage0000.png", b"this is not a png file at all"),
               ("garbage0000.txt", b"garbage")]
    for key, reason in (("trunc0000", "undecodable_image"), ("nocap0000", "missing_caption"),
                        ("noimg0000", "missing_image"), ("garbage0000", "undecodable_image")):
        sample.planted["quarantine"].append({"id": f"shapes/shapes_000.tar#{key}",
                                             "reason": reason})
    small = Image.new("RGB", (20, 20), (255, 0, 0))
    wide = _scene([("circle", "red", "small", "left")]).resize((560, 112))
    wds[0] += [("tiny0000.png", _png(small)), ("tiny0000.txt", b"a tiny red square"),
               ("wide0000.png", _png(wide)), ("wide0000.txt", b"a very wide picture")]
    sample.planted["filtered_images"] += [
        {"id": "shapes/shapes_000.tar#tiny0000", "reason": "image_too_small"},
        {"id": "shapes/shapes_000.tar#wide0000", "reason": "image_aspect_ratio"}]
    for f in range(2):
        buf = io.BytesIO()
        _tar_to(buf, wds[f])
        sample.write(f"images/wds/shapes_{f:03d}.tar", buf.getvalue())
    # a shard cut in the middle of its third sample's picture
    broken = []
    for i in range(3):
        broken += [(f"late{i:04d}.png", _png(pictures[260 + i])),
                   (f"late{i:04d}.txt", _caption(scenes[260 + i]).encode())]
    buf = io.BytesIO()
    _tar_to(buf, broken)
    third_picture = sum(512 + -(-len(data) // 512) * 512 for _, data in broken[:4]) + 512
    sample.write("images/wds/shapes_002.tar", buf.getvalue()[:third_picture + 100])
    sample.planted["quarantine"].append({"id": "shapes/shapes_002.tar#late0002+rest",
                                         "reason": "unreadable_file"})
    # image folder
    for i in range(263, 360):
        sample.write(f"images/folder/scene{i:04d}.png", _png(pictures[i]))
        sample.write(f"images/folder/scene{i:04d}.txt", _caption(scenes[i]))
    sample.write("images/folder/trunc.png", _png(pictures[0])[:150])
    sample.write("images/folder/trunc.txt", "a truncated picture")
    sample.write("images/folder/zero.png", b"")
    sample.write("images/folder/zero.txt", "an empty file")
    sample.write("images/folder/nocaption.png", _png(pictures[2]))
    for name, reason in (("trunc.png", "undecodable_image"), ("zero.png", "undecodable_image"),
                         ("nocaption.png", "missing_caption")):
        sample.planted["quarantine"].append({"id": f"shapes_folder/{name}#0", "reason": reason})
    # a copy of a wds scene in the folder: the wds copy (earlier source) is kept
    sample.write("images/folder/again.png", _png(pictures[20]))
    sample.write("images/folder/again.txt", _caption(scenes[20]))
    sample.planted["image_duplicates"].append({"id": "shapes_folder/again.png#0",
                                               "of": wds_ids[20]})


def _tar_to(buf: io.BytesIO, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))


def build_videos(sample: Sample, rng: random.Random) -> None:
    clips = [(s, c, d) for s in SHAPES for c in COLORS for d in ("right", "left", "down", "up")]
    rng.shuffle(clips)
    for i, (shape, color, direction) in enumerate(clips[:24]):
        folder = f"video/frames/clip{i:03d}"
        for f, img in enumerate(_clip(shape, color, direction, 6)):
            sample.write(f"{folder}/frame{f:02d}.png", _png(img))
        sample.write(f"{folder}/caption.txt", f"a {color} {shape} moves {direction}")
    for i, (shape, color, direction) in enumerate(clips[24:48]):
        sample.write(f"video/gif/clip{i:03d}.gif", _gif(_clip(shape, color, direction, 6)))
        sample.write(f"video/gif/clip{i:03d}.txt", f"a {color} {shape} moves {direction}")
    # the first frame-folder clip again as a GIF: the frame-folder copy (earlier source) is kept
    shape, color, direction = clips[0]
    sample.write("video/gif/again.gif", _gif(_clip(shape, color, direction, 6)))
    sample.write("video/gif/again.txt", f"the {color} {shape} again")
    sample.planted["video_duplicates"].append({"id": "motion_gif/again.gif#0",
                                               "of": "motion/clip000/caption.txt#0"})
    sample.write("video/gif/broken.gif", _gif(_clip("circle", "red", "up", 6))[:100])
    sample.write("video/gif/broken.txt", "a broken clip")
    sample.write("video/frames/bad/frame00.png", b"\x89PNG\r\n\x1a\n not really")
    sample.write("video/frames/bad/caption.txt", "a clip whose frame does not decode")
    sample.write("video/frames/empty/caption.txt", "a clip without frames")
    sample.planted["quarantine"] += [
        {"id": "motion_gif/broken.gif#0", "reason": "undecodable_image"},
        {"id": "motion/bad/caption.txt#0", "reason": "undecodable_image"},
        {"id": "motion/empty/caption.txt#0", "reason": "missing_image"}]


# ---------------------------------------------------------------- chat

CHAT_SOURCE = "chat_sample"  # configs/data/chat_sample.yaml's source name (in planted ids)
LOOKUP_TOWN = {"type": "function", "function": {
    "name": "lookup_town", "description": "Facts about a town of the valley.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two whole numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
_SYSTEM = ["You are a helpful guide to the towns of the valley.", "Answer briefly.",
           "You know the towns and animals of the region well."]
_TOWN_QA = [
    ("Which river is {name} on?", "{name} lies on the {dir} bank of the river {river}."),
    ("When was {name} founded?", "{name} was founded in the year {year} by a group of {trade}."),
    ("What is the market of {name} famous for?",
     "The market of {name} is famous for its {good} and its {good2}."),
    ("What can visitors see in {name}?",
     "Visitors often come to see {landmark}, which was built about {age} years ago."),
    ("Does {name} have a festival?",
     "Yes. Every {season} the people of {name} hold {festival} that lasts for {days} days."),
    ("How far is {name} from {city}?",
     "A road connects {name} with the city of {city}, about {dist} miles away."),
]
_ANIMAL_QA = [
    ("Where does the {name} live?", "The {name} is a {size} animal that lives in {habitat}."),
    ("What does the {name} eat?", "The {name} feeds mainly on {food}, which it finds {when}."),
    ("What does the {name} look like?",
     "The {name} has {cover} and a {tail} tail that helps it keep its balance."),
    ("How heavy is an adult {name}?",
     "An adult {name} weighs about {weight} kilograms and lives for up to {life} years."),
]
_PICTURE_QUESTIONS = ["What is in this picture?", "Describe this picture.",
                      "Which shapes do you see here?", "Tell me what this image shows."]


def _say(role: str, content) -> dict:
    return {"role": role, "content": content}


def _call(index: int, name: str, arguments: dict, as_text: bool) -> dict:
    """A tool call; the arguments as a JSON string (OpenAI) or an object (Hugging Face)."""
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments) if as_text
                         else arguments}}


def _town_record(town: dict) -> str:
    return json.dumps({"name": town["name"], "river": town["river"], "inhabitants": town["pop"]})


def _qa(template: tuple[str, str], slots: dict) -> list[dict]:
    return [_say("user", template[0].format(**slots)),
            _say("assistant", template[1].format(**slots))]


def _town_conversations(rng: random.Random, towns: list[dict]) -> list[dict]:
    out = []
    for i, town in enumerate(towns[:100]):  # one question each
        system = [_say("system", _SYSTEM[i % 3])] if i % 4 == 0 else []
        out.append({"messages": system + _qa(_TOWN_QA[i % len(_TOWN_QA)], town)})
    for i, town in enumerate(towns[100:140]):  # three questions about one town
        turns = [m for k in range(3) for m in _qa(_TOWN_QA[(i + k) % len(_TOWN_QA)], town)]
        out.append({"messages": turns})
    for i, town in enumerate(towns[140:170]):  # lookup_town, then the answer
        call = _call(0, "lookup_town", {"name": town["name"]}, as_text=i % 2 == 0)
        out.append({"tools": [LOOKUP_TOWN], "messages": [
            _say("user", f"How many people live in {town['name']}?"),
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": _town_record(town)},
            _say("assistant", f"{town['name']} has {town['pop']} inhabitants.")]})
    for a_town, b_town in zip(towns[170:180], towns[180:190]):  # two lookups in one turn
        a, b = a_town["pop"], b_town["pop"]
        calls = [_call(0, "lookup_town", {"name": a_town["name"]}, True),
                 _call(1, "lookup_town", {"name": b_town["name"]}, True)]
        out.append({"tools": [LOOKUP_TOWN], "messages": [
            _say("user", f"How many people live in {a_town['name']} and {b_town['name']} "
                         "together?"),
            {"role": "assistant", "content": "Let me look both towns up.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_0", "content": _town_record(a_town)},
            {"role": "tool", "tool_call_id": "call_1", "content": _town_record(b_town)},
            _say("assistant", f"{a_town['name']} has {a} inhabitants and {b_town['name']} "
                              f"{b}, so together they have {a + b}.")]})
    for _ in range(20):  # add
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        out.append({"tools": [ADD], "messages": [
            _say("user", f"What is {a} plus {b}?"),
            {"role": "assistant", "content": None,
             "tool_calls": [_call(0, "add", {"a": a, "b": b}, True)]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)},
            _say("assistant", f"{a} plus {b} is {a + b}.")]})
    return out


def _animal_conversations(animals: list[dict]) -> list[dict]:
    out = []
    for i, animal in enumerate(animals[:50]):
        turns = _qa(_ANIMAL_QA[i % len(_ANIMAL_QA)], animal)
        if i % 3 == 0:  # and a follow-up
            turns += _qa(_ANIMAL_QA[(i + 1) % len(_ANIMAL_QA)], animal)
        out.append({"messages": turns})
    return out


def _picture_conversations(sample: Sample, rng: random.Random) -> list[dict]:
    """Questions about rendered shape scenes; the answer names the shapes and colours. Some
    conversations show two pictures, some show one in a later turn."""
    scenes = _scenes(rng, 40)
    for i, scene in enumerate(scenes):
        sample.write(f"chat/images/scene{i:03d}.png", _png(_scene(scene)))

    def picture(i: int) -> dict:
        return {"type": "image", "image": f"images/scene{i:03d}.png"}

    out = []
    for i in range(28):
        question = {"type": "text", "text": _PICTURE_QUESTIONS[i % len(_PICTURE_QUESTIONS)]}
        content = [question, picture(i)] if i % 2 else [picture(i), question]
        out.append({"messages": [_say("user", content),
                                 _say("assistant", f"It shows {_caption(scenes[i])}.")]})
    for i in range(28, 36, 2):  # two pictures in one turn
        out.append({"messages": [
            _say("user", [{"type": "text", "text": "Here are two pictures."}, picture(i),
                          picture(i + 1), {"type": "text", "text": " How do they differ?"}]),
            _say("assistant", f"The first shows {_caption(scenes[i])}; the second shows "
                              f"{_caption(scenes[i + 1])}.")]})
    for i in range(36, 40):  # a picture in the second turn, after a text exchange
        out.append({"messages": [
            _say("user", "I will show you a drawing of some shapes."),
            _say("assistant", "Please do, I will describe it."),
            _say("user", [picture(i), {"type": "text", "text": "Here it is."}]),
            _say("assistant", f"The drawing shows {_caption(scenes[i])}.")]})
    for i in range(2):  # the same words about other pictures: no duplicates
        out.append({"messages": [_say("user", [picture(i), {"type": "text",
                                                            "text": "Is this a drawing?"}]),
                                 _say("assistant", "Yes, it is a drawing of shapes.")]})
    return out


def _chat_text_of(sample: Sample, record: dict) -> str:
    """The pipeline's canonical text of a sample conversation (its pictures already written)."""
    digests = [picture_digest((sample.root / "chat" / image).read_bytes())
               for _, image in image_parts(record["messages"])]
    return chat_text(record["messages"], digests)


def _variant(record: dict, kind: str) -> dict:
    """A copy that dedup must find exact: other case, other spacing or other call ids."""
    copy = json.loads(json.dumps(record))
    for m in copy["messages"]:
        if kind == "case" and isinstance(m.get("content"), str):
            m["content"] = m["content"].lower()
        if kind == "spacing" and isinstance(m.get("content"), str):
            m["content"] = "  " + m["content"].replace(" ", "  ") + " "
        if kind == "call ids":
            for call in m.get("tool_calls") or []:
                call["id"] = "toolu_" + call["id"]
            if "tool_call_id" in m:
                m["tool_call_id"] = "toolu_" + m["tool_call_id"]
    return copy


def build_chat(sample: Sample, rng: random.Random, cfg: DataConfig) -> None:
    """chat/chat_000.jsonl (towns and animals), chat_001.jsonl (tools and pictures),
    chat_002.jsonl (planted duplicates and broken records), chat/images/."""
    planted: dict[str, list] = {k: [] for k in (
        "distinct", "exact_duplicates", "near_duplicates", "quarantine", "filtered",
        "two_pictures", "same_words_other_picture")}
    sample.planted["chat"] = planted
    towns = _town_conversations(rng, sample.towns)
    files = [towns[:140] + _animal_conversations(sample.animals),
             towns[140:] + _picture_conversations(sample, rng), []]
    ids = []
    for f, records in enumerate(files[:2]):
        for i, record in enumerate(records):
            records[i] = {"id": f"chat-{f}-{i}", **record}
            ids.append(f"{CHAT_SOURCE}/chat_{f:03d}.jsonl#{i}")
            if len(image_parts(record["messages"])) == 2:
                planted["two_pictures"].append(ids[-1])
            if record["messages"][-1]["content"] == "Yes, it is a drawing of shapes.":
                planted["same_words_other_picture"].append(ids[-1])
    planted["distinct"] = list(ids)
    records = files[0] + files[1]

    def add(record) -> str:
        files[2].append(record)
        return f"{CHAT_SOURCE}/chat_002.jsonl#{len(files[2]) - 1}"

    # exact duplicates: a copy, other case, other spacing, other tool call ids, a copy showing
    # the same picture file
    for kind, k in (("copy", 3), ("case", 105), ("spacing", 60), ("call ids", 225),
                    ("picture", 262)):
        copy = {**_variant(records[k], kind), "id": f"copy-{kind}"}
        planted["exact_duplicates"].append({"id": add(copy), "of": ids[k]})
    # near duplicates: a long conversation whose last answer gains a few words
    ngram = cfg.dedup.ngram
    for k in (100, 110, 120, 130):
        near = json.loads(json.dumps(records[k]))
        near["messages"][-1]["content"] += " Enjoy your visit."
        near["id"] = f"near-{k}"
        j = jaccard(word_shingles(_chat_text_of(sample, records[k]), ngram),
                    word_shingles(_chat_text_of(sample, near), ngram))
        assert 0.8 <= j < 1.0, j
        planted["near_duplicates"].append({"id": add(near), "of": ids[k],
                                           "jaccard": round(j, 4)})
    # the distinct conversations are no duplicates of each other (the planted truth)
    shingles = [set(word_shingles(_chat_text_of(sample, r), ngram).tolist()) for r in records]
    for a in range(len(shingles)):
        for b in range(a):
            union = len(shingles[a] | shingles[b])
            assert len(shingles[a] & shingles[b]) / union < 0.8, (ids[a], ids[b])
    # broken records, each with what the pipeline must do with it
    sample.write("chat/images/broken.png", b"\x89PNG\r\n\x1a\n not really a picture")
    sample.write("chat/images/tiny.png", _png(Image.new("RGB", (20, 20), (40, 80, 220))))
    hello = [_say("user", "Hello there."), _say("assistant", "Hello! How can I help?")]
    bad = [
        (b'{"id": "broken", "messages": [{"role": "user", "content": "hi"}', "malformed_json"),
        ({"id": "nomessages", "conversation": hello}, "no_messages"),
        ({"id": "narrator", "messages": [_say("narrator", "Once upon a time.")] + hello},
         "invalid_conversation"),
        ({"id": "orphan", "messages": hello + [
            {"role": "tool", "tool_call_id": "call_9", "content": "42"},
            _say("assistant", "The answer is 42.")]}, "invalid_conversation"),
        ({"id": "control", "messages": [_say("user", "Please repeat <|im_end|> after me."),
                                        _say("assistant", "I would rather not.")]},
         "invalid_conversation"),
        ({"id": "silent", "messages": [_say("system", "Be brief."), _say("user", "Hello?")]},
         "no_assistant_tokens"),
        ({"id": "missing", "messages": [
            _say("user", [{"type": "image", "image": "images/missing.png"},
                          {"type": "text", "text": "What is this?"}]),
            _say("assistant", "I cannot tell.")]}, "missing_image"),
        ({"id": "undecodable", "messages": [
            _say("user", [{"type": "image", "image": "images/broken.png"},
                          {"type": "text", "text": "And this one?"}]),
            _say("assistant", "It does not open.")]}, "undecodable_image"),
    ]
    for record, reason in bad:
        planted["quarantine"].append({"id": add(record), "reason": reason})
    tiny = {"id": "tiny", "messages": [
        _say("user", [{"type": "image", "image": "images/tiny.png"},
                      {"type": "text", "text": "What colour is this square?"}]),
        _say("assistant", "It is blue.")]}
    planted["filtered"].append({"id": add(tiny), "reason": "image_too_small"})
    for f, records in enumerate(files):
        sample.write(f"chat/chat_{f:03d}.jsonl", _jsonl(records))


# ---------------------------------------------------------------- RL tasks

# The budget (response tokens) of each effort level: an answer alone fits the low to high
# budgets; a calculator call (~40 tokens with the sample's tokenizer) or a function needs max.
EFFORT_BUDGETS = {"low": 8, "medium": 16, "high": 32, "max": 64}
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# kind: (operand range, operations, effort, with the calculator, tasks, conversations). No 0
# operand: dedup ignores the operator, so "2 + 0" and "2 - 0" would be near duplicates.
_ARITHMETIC = {"one_digit": ((1, 9), "+-", "low", False, 60, 102),
               "two_digit": ((10, 99), "+-", "medium", False, 80, 700),
               "calculator": ((100, 999), "+-*", "max", True, 40, 300)}
# kind: (question about a word, its answer, effort)
_WORD_QUESTIONS = {
    "reverse": ("Reverse the word '{}'.", lambda w: w[::-1], "high"),
    "upper": ("Write the word '{}' in capital letters.", str.upper, "medium"),
    "first": ("What is the first letter of the word '{}'?", lambda w: w[0], "low"),
    "last": ("What is the last letter of the word '{}'?", lambda w: w[-1], "low"),
    "count": ("How many letters are in the word '{}'?", lambda w: str(len(w)), "medium"),
}
_WORD_TASKS, _WORD_SFT = 40, 150  # of each kind
# function: (request, solution, its tests' assertions), all of a constant k
_CODE_QUESTIONS = {
    "shift": ("Write a Python function shift(x) that returns x plus {k}.",
              "def shift(x):\n    return x + {k}",
              lambda k: [f"shift(0) == {k}", f"shift({-k}) == 0", f"shift(10) == {10 + k}"]),
    "scale": ("Write a Python function scale(x) that returns x times {k}.",
              "def scale(x):\n    return x * {k}",
              lambda k: ["scale(0) == 0", f"scale(3) == {3 * k}", f"scale(-2) == {-2 * k}"]),
    "repeat": ("Write a Python function repeat(word) that returns the word repeated {k} times.",
               "def repeat(word):\n    return word * {k}",
               lambda k: [f"repeat('ab') == {'ab' * k!r}", "repeat('') == ''"]),
    "is_multiple": ("Write a Python function is_multiple(n) that returns whether n is "
                    "divisible by {k}.",
                    "def is_multiple(n):\n    return n % {k} == 0",
                    lambda k: [f"is_multiple({k}) is True", f"is_multiple({3 * k}) is True",
                               f"is_multiple({3 * k + 1}) is False", "is_multiple(0) is True"]),
}
_CODE_CONSTANTS = range(2, 41)
_CODE_TASKS, _CODE_SFT = 16, 140


@dataclass
class _Example:
    """A question with its answer: a task (prompt and verifier fields) or, for other prompts, a
    conversation (the prompt and the assistant's reply)."""

    domain: str
    prompt: str
    effort: str
    check: dict  # the task's verifier fields
    reply: list[dict]  # the messages after the prompt: tool calls and results, the answer
    tools: list[dict] | None = None


def _arithmetic(a: int, op: str, b: int, effort: str, tool: bool) -> _Example:
    answer = str(_OPERATIONS[op](a, b))
    reply = [_say("assistant", answer)]
    if not tool:
        return _Example("math", f"What is {a} {op} {b}?", effort,
                        {"verifier": "exact_match", "answer": answer}, reply)
    call = _call(0, "calculate", {"expression": f"{a} {op} {b}"}, as_text=True)
    reply = [{"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": answer}] + reply
    return _Example("math", f"What is {a} {op} {b}?", effort,
                    {"verifier": "exact_match", "answer": answer, "environment": "calculator"},
                    reply, [CALCULATE])


def _word(word: str, kind: str) -> _Example:
    question, answer, effort = _WORD_QUESTIONS[kind]
    return _Example("string", question.format(word), effort,
                    {"verifier": "exact_match", "answer": answer(word)},
                    [_say("assistant", answer(word))])


def _code(function: str, k: int) -> _Example:
    request, solution, assertions = _CODE_QUESTIONS[function]
    code = solution.format(k=k)
    return _Example("code", request.format(k=k), "max",
                    {"verifier": "python_unit_tests", "solution": code,
                     "tests": "".join(f"assert {a}\n" for a in assertions(k))},
                    [_say("assistant", f"```python\n{code}\n```")])


def _examples(rng: random.Random):
    """(kind, its examples, how many of them are tasks): distinct prompts, drawn at random."""
    for kind, ((lo, hi), ops, effort, tool, tasks, conversations) in _ARITHMETIC.items():
        size = hi - lo + 1  # (a, op, b) drawn by their index, a and b in [lo, hi]
        picks = rng.sample(range(size * size * len(ops)), tasks + conversations)
        yield kind, [_arithmetic(lo + i // (size * len(ops)), ops[i % len(ops)],
                                 lo + i // len(ops) % size, effort, tool) for i in picks], tasks
    words = sorted({a + b for a in _SYL for b in _SYL})  # invented words of two syllables
    for kind in _WORD_QUESTIONS:
        yield kind, [_word(w, kind) for w in rng.sample(words, _WORD_TASKS + _WORD_SFT)], \
            _WORD_TASKS
    functions = [(f, k) for f in _CODE_QUESTIONS for k in _CODE_CONSTANTS]
    yield "code", [_code(f, k) for f, k in rng.sample(functions, _CODE_TASKS + _CODE_SFT)], \
        _CODE_TASKS


def build_tasks(sample: Sample, rng: random.Random) -> None:
    """tasks/tasks.jsonl (RL tasks) and tasks/sft.jsonl (conversations on the other prompts)."""
    tasks, conversations = [], []
    for kind, examples, n_tasks in _examples(rng):
        tasks += [{"id": f"{kind}-{j:03d}", "domain": e.domain, "prompt": e.prompt, **e.check,
                   "budget": EFFORT_BUDGETS[e.effort], "effort": e.effort}
                  for j, e in enumerate(examples[:n_tasks])]
        conversations += [{"id": f"sft-{kind}-{j:03d}", **({"tools": e.tools} if e.tools else {}),
                           "messages": [_say("user", e.prompt), *e.reply]}
                          for j, e in enumerate(examples[n_tasks:])]
    rng.shuffle(tasks)
    rng.shuffle(conversations)
    sample.write("tasks/tasks.jsonl", _jsonl(tasks))
    sample.write("tasks/sft.jsonl", _jsonl(conversations))


def make_sample(root: Path = SAMPLE_DIR) -> dict:
    cfg = DataConfig()
    if root.exists():
        shutil.rmtree(root)
    sample = Sample(root)
    rng = random.Random(SEED)
    build_text(sample, rng, cfg)
    build_images(sample, rng, cfg)
    build_videos(sample, rng)
    build_chat(sample, random.Random(SEED + 1), cfg)  # its own stream: the rest stays as it was
    build_tasks(sample, random.Random(SEED + 2))  # its own stream too
    sample.write("planted.json", json.dumps(sample.planted, indent=1, sort_keys=True) + "\n")
    return sample.planted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SAMPLE_DIR)
    args = parser.parse_args()
    planted = make_sample(args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB): "
          + ", ".join(f"{k}={len(v)}" for k, v in planted.items()))


if __name__ == "__main__":
    main()
