"""RULER-style synthetic long-context tasks, generated locally from fixed seeds.

Nothing is downloaded: every haystack, needle, word list and fact comes from a seeded
``random.Random`` and the small word lists below. A sample is sized in tokens of the tokenizer it
is made for: the chat-templated prompt (see ``build_chat``) is filled with haystack until it is
just under ``length`` tokens (within ``TOLERANCE``, 3 %, below it).

Example::

    from kvpolicy.eval.tasks import TASKS, build_chat, make_sample, score
    from kvpolicy.models import load_model

    model, tok = load_model("smollm2")
    sample = make_sample("niah_single", tok, length=2048, seed=0)
    inputs = build_chat(tok, sample)
    out = model.generate(**inputs, max_new_tokens=TASKS[sample.task].max_new_tokens, do_sample=False)
    prediction = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(score(sample.task, prediction, sample.answers))  # 0.0 .. 100.0

Tasks (the keys of ``TASKS``), after RULER (Hsieh et al., 2024):

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {7 digits}." in
  varied filler sentences; asks for the number of {key}.
- ``niah_multikey``: the target needle among 3 distractor needles with other keys.
- ``niah_multivalue``: one key with 4 values at 4 depths; all 4 must be given.
- ``niah_multiquery``: 4 keys asked at once; all 4 values must be given.
- ``variable_tracking``: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in
  filler; asks for every variable that holds 12345 (all 5 names).
- ``common_words``: a numbered word list where 5 words are much more frequent; asks for them.
- ``frequent_words``: "coded text" of pseudo-words drawn Zipf(2); asks for the 3 most frequent.
- ``qa``: a document of facts about fictional entities ("The capital of Verlandia is Morsk."),
  every relation mixed; one question about one of them.

Every prompt states the question before the haystack and again after it, and asks for a brief
answer; ``build_chat`` then opens the assistant's reply with RULER's answer prefix ("The special
magic number for {key} mentioned in the provided text is"), which tiny models need.
``Task.max_new_tokens`` is enough for a whole answer (64 for the four-number and five-name ones).

Scoring follows RULER: ``string_match_all`` (the share of answers found in the prediction,
case-insensitive) for all tasks but ``qa``, which uses ``string_match_part`` (100 if any answer
is found). Scores are in [0, 100].
"""

from __future__ import annotations

import functools
import operator
import random
import string
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from kvpolicy.errors import ConfigError, UnknownNameError

__all__ = [
    "TASKS",
    "TOLERANCE",
    "METRICS",
    "Sample",
    "Task",
    "build_chat",
    "chat_text",
    "count_tokens",
    "make_sample",
    "make_samples",
    "score",
    "string_match_all",
    "string_match_part",
]

TOLERANCE = 0.03
"""A sample's chat-templated prompt is at most ``length`` and at least ``(1 - TOLERANCE) * length`` tokens."""


# ----------------------------------------------------------------------------------------------
# Samples, chat rendering, scoring
# ----------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One generated task instance.

    ``prompt`` is the user message; ``answers`` every string the reply should contain (for
    ``qa``, any one of them); ``length`` the target size in tokens and ``seed`` the seed it was
    made from; ``question`` the question alone. ``answer_prefix`` is the start of the assistant's
    reply that ``build_chat`` appends after the generation prompt (RULER's answer prefix; it
    steers small models to answer at once); ``tokens`` the size of ``build_chat``'s output for the
    tokenizer the sample was made with.
    """

    task: str
    prompt: str
    answers: list[str]
    length: int
    seed: int
    question: str
    answer_prefix: str = ""
    tokens: int = 0

    @property
    def metric(self) -> str:
        """The name of the metric that scores this sample (``string_match_all`` or ``string_match_part``)."""
        return get_task(self.task).metric


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> str:
    """The text ``build_chat`` tokenizes: the chat template applied to ``sample.prompt`` as one user
    message with the generation prompt, then ``sample.answer_prefix`` (when ``answer_prefix``).
    Without a chat template: the prompt, a newline, then the answer prefix."""
    prefix = sample.answer_prefix if answer_prefix else ""
    if _has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.prompt}], tokenize=False, add_generation_prompt=True
        )
        return text + prefix
    return sample.prompt + "\n" + prefix


def build_chat(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> dict[str, Any]:
    """``{"input_ids", "attention_mask"}`` tensors of shape ``(1, tokens)`` for ``model.generate``.

    Applies the tokenizer's chat template (one user message, ``add_generation_prompt=True``)
    and appends the sample's answer prefix; a tokenizer without a chat template gets the plain
    prompt with its usual special tokens (BOS).
    """
    text = chat_text(tokenizer, sample, answer_prefix=answer_prefix)
    encoded = tokenizer(text, add_special_tokens=not _has_chat_template(tokenizer), return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def count_tokens(tokenizer: Any, sample: Sample, *, answer_prefix: bool = True) -> int:
    """How many tokens ``build_chat(tokenizer, sample)`` produces (without building tensors)."""
    text = chat_text(tokenizer, sample, answer_prefix=answer_prefix)
    return len(tokenizer(text, add_special_tokens=not _has_chat_template(tokenizer))["input_ids"])


def _check_answers(answers: Sequence[str]) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ConfigError("answers must hold at least one expected string, got none")
    return answers


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: 100 * the share of ``answers`` contained in ``prediction`` (case-insensitive)."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return 100.0 * sum(answer.lower() in pred for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_part``: 100 if any of ``answers`` is contained in ``prediction`` (case-insensitive), else 0."""
    answers = _check_answers(answers)
    pred = prediction.lower()
    return 100.0 if any(answer.lower() in pred for answer in answers) else 0.0


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def score(task: str, prediction: str, answers: Sequence[str]) -> float:
    """Score one prediction for ``task`` with that task's metric; a float in [0, 100]."""
    return METRICS[get_task(task).metric](prediction, answers)


# ----------------------------------------------------------------------------------------------
# Word lists (small, embedded: nothing is downloaded)
# ----------------------------------------------------------------------------------------------

_ADJECTIVES = sorted(set("""
able ancient angry awake bitter blue bold brave brief bright broad broken busy calm careful cheap
clean clever cold cool crisp cruel curious dark deep dense distant dry dull eager early easy empty
fair famous fancy fast fierce flat fresh friendly gentle giant glad golden grand green grey happy
hard heavy hidden hollow honest huge humble icy jolly keen kind large late lazy light little lively
lonely long loud lucky mellow mighty modern narrow neat nervous noble odd old orange pale patient
plain polite proud purple quick quiet rapid rare red rich rough round royal rusty sacred safe salty
sharp shiny short shy silent silver simple slow small smooth soft solid sour spicy steady steep
sticky stormy strange strict strong sudden sunny super sweet swift tall tame tender thick thin tidy
tiny tough tricky vast violet warm weak wealthy wet white wide wild wise wooden young yellow zesty
""".split()))

_NOUNS = sorted(set("""
acorn actor album anchor angle apple apron arch arrow attic badge bakery ball banana band banner
barn basket bath beach beacon bean bear beard bell bench berry bicycle bird blanket blossom boat
bone book boot bottle boulder bowl box branch bread brick bridge brook brush bucket butter button
cabin cactus cake camel camera candle canoe canyon captain carpet carrot castle cave cellar chair
chalk cheese cherry chimney circle city cliff clock cloud coast coat coin comet compass cookie
copper corner cottage cotton crayon creek crown crystal cup curtain cushion daisy desert diamond
dolphin door dragon drum eagle engine falcon feather fence fern field flag flame flute forest
fountain fox frog garden gate glacier glove goat grape guitar hammer harbor harp hat hawk helmet
hill honey horse island jacket jar jewel jungle kettle key kite ladder lake lamp lantern leaf lemon
letter library lily lion lizard locket magnet mango maple marble meadow melon mirror monkey moon
mountain mouse needle nest ocean olive orchard otter owl paddle palace panda paper parrot peach
pearl pebble pencil penguin pepper piano pillow pine planet plum pocket pond potato puzzle quilt
rabbit radio rainbow raven ribbon river robin rocket rope rose saddle sail salmon sand scarf shell
ship shoe shovel sparrow spoon spring squirrel star stone storm stream sugar summit swan sword
table teapot temple tent thunder tiger timber tomato tower towel tractor trail train tree trumpet
tulip tunnel turtle umbrella valley vase violin wagon walnut wave whale whistle willow window
wolf yard zebra
""".split()))

_VERBS = sorted(set("""
accept admire allow answer arrive ask bake begin believe borrow break bring build burn buy call
carry catch change choose clean climb close collect cook count cover cross cut dance decide
deliver describe design dig draw dream drink drive eat enjoy enter explain fall feed fill find
finish fix fly fold follow forget gather give grow guard guess hang help hide hold hunt invent
join jump keep kick knock laugh learn lend lift listen live lose make measure melt mend move
notice offer open order paint pass plant play polish pour pray print pull push reach read repair
rest ride ring rise roll run save search sell send sew shake share shine shout sing sit sleep
smile sort speak spend spin stand start stay steal stir swim swing talk teach tell think throw
touch trade travel trust turn visit wait wake walk wander wash watch wave weave win wish work
wrap write
""".split()))

_ANIMALS = sorted(set("""
badger beaver bison bobcat buffalo camel cheetah cobra condor coyote crane deer dingo donkey eagle
elk falcon ferret flamingo gazelle gecko giraffe hedgehog heron hyena ibis iguana jackal jaguar
kangaroo koala lemur leopard llama lynx marmot meerkat mole moose narwhal ocelot okapi opossum
orca osprey otter panther pelican porcupine puffin raccoon reindeer salamander seal stork tapir
toucan walrus weasel wolverine yak
""".split()))

_PROFESSIONS = sorted(set("""
architect baker carpenter chemist dentist diplomat engineer farmer firefighter geologist jeweler
journalist lawyer librarian locksmith mechanic musician navigator nurse painter pharmacist pilot
plumber potter sculptor surgeon tailor teacher translator veterinarian
""".split()))

# Filler grammar for the needle haystacks: varied, plain, digit-free sentences.
_SUBJECTS = (
    "the old fisherman", "a young painter", "the village baker", "our new neighbor", "the quiet librarian",
    "a tired traveler", "the harbor master", "my grandmother", "the school teacher", "a curious child",
    "the town council", "the night watchman", "a wandering musician", "the head gardener", "the ship captain",
    "a retired soldier", "the shy apprentice", "the local blacksmith", "a famous poet", "the mountain guide",
    "the innkeeper", "a group of students", "the stable boy", "the weaver", "an elderly farmer",
    "the clockmaker", "a traveling merchant", "the young nurse", "the choir director", "the ferryman",
)
_PAST_VERBS = (
    "carried", "painted", "noticed", "repaired", "described", "borrowed", "admired", "followed", "collected",
    "cleaned", "sold", "found", "lost", "built", "opened", "polished", "wrapped", "measured", "sketched",
    "studied", "moved", "delivered", "mended", "decorated", "inspected", "photographed", "returned", "hid",
    "weighed", "counted", "traded", "praised", "ignored", "guarded", "remembered", "discovered", "shared",
    "packed", "dusted", "labeled",
)
_OBJECTS = (
    "a wooden chair", "the broken fence", "an old map", "the morning newspaper", "a basket of pears",
    "the heavy anchor", "a bundle of letters", "the silver teapot", "a box of candles", "the faded banner",
    "a pair of boots", "the copper kettle", "a jar of honey", "the wool blanket", "a bag of flour",
    "the painted sign", "a crate of apples", "the iron gate", "a stack of books", "the garden bench",
    "a loaf of bread", "the rusty lantern", "a roll of cloth", "the fishing net", "a bowl of cherries",
    "the leather saddle", "a set of keys", "the small boat", "a bunch of tulips", "the stone statue",
    "a spool of thread", "the glass vase", "a sack of potatoes", "the oak table", "a bottle of ink",
    "the wind chime", "a string of pearls", "the tool chest", "a cup of tea", "the family portrait",
)
_TAILS = (
    "before sunrise", "near the harbor", "after a long day", "without saying a word", "in the small garden",
    "during the winter festival", "with great care", "behind the old mill", "on a rainy afternoon",
    "at the edge of the forest", "while the bells were ringing", "in front of the market", "late at night",
    "under the bright moon", "next to the river", "for the first time", "in the crowded square",
    "beside the quiet pond", "on the way home", "at the end of the season", "in the dusty attic",
    "across the wide field", "inside the cold cellar", "along the coastal road", "by the warm fire",
    "after the storm had passed", "at the busy train station", "in the shade of the willow",
    "on top of the hill", "just before dinner",
)
_OPENERS = (
    "Later that week,", "Every spring,", "Once again,", "To everyone's surprise,", "As usual,",
    "Without any hurry,", "Early in the morning,", "For reasons nobody knew,", "Just as expected,",
    "On most days,", "Long ago,", "In the meantime,",
)
_REMARKS = (
    "The weather stayed mild for most of the week.", "Nobody in the village could remember a quieter year.",
    "The road to the valley was long and winding.", "Fresh bread was sold at the market every morning.",
    "The river ran slowly past the old stone houses.", "Children played in the square until it grew dark.",
    "A light wind moved through the tall grass.", "The lamps along the street were lit one by one.",
    "Travelers often stopped at the inn to rest.", "The hills were covered in purple heather.",
    "The bells of the chapel rang at noon.", "Gulls circled above the fishing boats.",
    "The orchard smelled of ripe apples in the autumn.", "Snow fell softly on the rooftops.",
    "The market was busier than it had been in years.", "A thin mist lay over the meadow at dawn.",
)


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _filler_sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(_REMARKS)
    subject, verb, obj, tail = rng.choice(_SUBJECTS), rng.choice(_PAST_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS)
    if kind < 0.35:
        return f"{rng.choice(_OPENERS)} {subject} {verb} {obj} {tail}."
    if kind < 0.5:
        other = rng.choice(_SUBJECTS)
        return f"{_cap(subject)} {verb} {obj} {tail}, and {other} {rng.choice(_PAST_VERBS)} {rng.choice(_OBJECTS)}."
    return f"{_cap(subject)} {verb} {obj} {tail}."


def _filler(rng: random.Random, n: int) -> list[str]:
    """``n`` filler sentences; the same stream gives the same prefix for any ``n``."""
    return [_filler_sentence(rng) for _ in range(n)]


def _insert(sentences: list[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """Insert each ``(depth, text)`` at ``depth`` (0 = start, 1 = end) of ``sentences``; order of equal depths kept."""
    out = list(sentences)
    n = len(sentences)
    # Insert deepest first so earlier indices stay valid; stable for ties (reverse of input order).
    placed = sorted(enumerate(needles), key=lambda item: (item[1][0], item[0]), reverse=True)
    for _, (depth, text) in placed:
        out.insert(round(depth * n), text)
    return out


def _paragraphs(sentences: Sequence[str], per: int = 6) -> str:
    return "\n".join(" ".join(sentences[i : i + per]) for i in range(0, len(sentences), per))


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _distinct(make: Callable[[], str], count: int, taken: set[str] | None = None) -> list[str]:
    taken = set() if taken is None else taken
    out: list[str] = []
    while len(out) < count:
        value = make()
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


# ----------------------------------------------------------------------------------------------
# Task builders: (rng, n, length) -> _Parts, n the amount of filler (monotone in tokens)
# ----------------------------------------------------------------------------------------------

RngFactory = Callable[[str], random.Random]


@dataclass
class _Parts:
    prompt: str
    question: str
    answers: list[str]
    answer_prefix: str


_NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
_NIAH_KEYS = 4  # multikey: 1 target + 3 distractors; multiquery: 4 queried keys
_NIAH_VALUES = 4  # multivalue


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_prompt(question: str, sentences: list[str], brief: str) -> str:
    return f"{_NIAH_INTRO}\nQuestion: {question}\n\n{_paragraphs(sentences)}\n\nQuestion: {question} {brief}"


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _build_niah(rng: RngFactory, n: int, *, keys: int, values: int, queried: int) -> _Parts:
    needles_rng = rng("needles")
    key_list = _distinct(lambda: _key(needles_rng), keys)
    numbers = _distinct(lambda: _number(needles_rng, 7), keys * values)
    needles: list[tuple[float, str]] = []
    values_of: dict[str, list[str]] = {}
    for i, key in enumerate(key_list):
        values_of[key] = numbers[i * values : (i + 1) * values]
        for value in values_of[key]:
            needles.append((needles_rng.random(), _needle(key, value)))
    asked = key_list[:queried]
    answers = [value for key in asked for value in values_of[key]]
    sentences = _insert(_filler(rng("filler"), n), needles)
    if queried == 1 and values == 1:
        question = f"What is the special magic number for {asked[0]} mentioned in the provided text?"
        brief = "Answer briefly with just the number."
        prefix = f"The special magic number for {asked[0]} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {_join_keys(asked)} mentioned in the provided text?"
        brief = "Answer briefly with just the numbers."
        prefix = f"The special magic numbers for {_join_keys(asked)} mentioned in the provided text are"
    return _Parts(_niah_prompt(question, sentences, brief), question, answers, prefix)


def _build_niah_single(rng: RngFactory, n: int, length: int) -> _Parts:
    return _build_niah(rng, n, keys=1, values=1, queried=1)


def _build_niah_multikey(rng: RngFactory, n: int, length: int) -> _Parts:
    return _build_niah(rng, n, keys=_NIAH_KEYS, values=1, queried=1)


def _build_niah_multivalue(rng: RngFactory, n: int, length: int) -> _Parts:
    return _build_niah(rng, n, keys=1, values=_NIAH_VALUES, queried=1)


def _build_niah_multiquery(rng: RngFactory, n: int, length: int) -> _Parts:
    return _build_niah(rng, n, keys=_NIAH_KEYS, values=1, queried=_NIAH_KEYS)


_VT_HOPS = 4


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _build_variable_tracking(rng: RngFactory, n: int, length: int) -> _Parts:
    chain_rng = rng("chain")
    names = _distinct(lambda: _var_name(chain_rng), _VT_HOPS + 1)
    value = _number(chain_rng, 5)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {new} = VAR {old}." for old, new in zip(names, names[1:])]
    depths = sorted(chain_rng.random() for _ in statements)
    sentences = _insert(_filler(rng("filler"), n), list(zip(depths, statements)))
    question = f"Find all variables that are assigned the value {value} in the text."
    prompt = (
        "Memorize and track the chain of variable assignments hidden in the following text.\n"
        f"Question: {question}\n\n{_paragraphs(sentences)}\n\n"
        f"Question: {question} Answer briefly with just the variable names."
    )
    # Ending on "VAR" steers a small model to list names rather than repeat the value.
    prefix = f"According to the chain of variable assignments in the text, the variables assigned the value {value} are: VAR"
    return _Parts(prompt, question, names, prefix)


_CWE_TOP_K = 5
_CWE_VOCAB = tuple(sorted(set(_NOUNS) | set(_ADJECTIVES) | set(_VERBS) | set(_ANIMALS)))
_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)


@functools.lru_cache(maxsize=4)
def _inside_others(vocab: tuple[str, ...]) -> frozenset[str]:
    """The words of ``vocab`` that are a substring of another word of it ("art" of "party")."""
    return frozenset(word for word in vocab if any(word != other and word in other for other in vocab))


def _unambiguous(candidates: Iterable[str], inside: frozenset[str], text: str, count: int) -> list[str]:
    """The first ``count`` candidates that are not in ``inside`` (see ``_inside_others``) nor a substring of ``text``.

    A reply that names another word, or echoes the instructions, then never matches an answer.
    """
    text = text.lower()
    out = []
    for word in candidates:
        if word in text or word in inside:
            continue
        out.append(word)
        if len(out) == count:
            return out
    raise AssertionError("not enough unambiguous words")  # the embedded lists have plenty


def _build_common_words(rng: RngFactory, n: int, length: int) -> _Parts:
    k = _CWE_TOP_K
    question = f"What are the {k} most common words in the list?"
    prefix = f"The top {k} words that appear most often in the list are:"
    words_rng = rng("words")
    vocab = list(_CWE_VOCAB)
    words_rng.shuffle(vocab)
    echo = f"{_CWE_INTRO} {question} {prefix} answer briefly with just the words"
    common = _unambiguous(vocab, _inside_others(_CWE_VOCAB), echo, k)
    rare_pool = [word for word in vocab if word not in common]
    rare = [rare_pool[i % len(rare_pool)] for i in range(n)]
    rare_max = -(-n // len(rare_pool))
    # Common words stand out at every size: at least 3x the most frequent rare word.
    freq = max(6, length // 200, 3 * rare_max)
    items = rare + common * freq
    rng("order").shuffle(items)
    listing = "\n".join(f"{i + 1}. {word}" for i, word in enumerate(items))
    prompt = f"{_CWE_INTRO}\nQuestion: {question}\n\n{listing}\n\nQuestion: {question} Answer briefly with just the words."
    return _Parts(prompt, question, common, prefix)


_FWE_ALPHA = 2.0
_FWE_VOCAB = 200
_FWE_MIN_WORDS = 60


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def _zipf_counts(total: int, size: int, alpha: float) -> list[int]:
    """Counts for ranks 1..size summing to ``total``, proportional to rank**-alpha (largest remainder)."""
    weights = [rank**-alpha for rank in range(1, size + 1)]
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(size), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _build_frequent_words(rng: RngFactory, n: int, length: int) -> _Parts:
    question = "What are the three most frequently appeared words in the coded text?"
    intro = (
        "Read the following coded text and track the frequency of each coded word. "
        "Find the three most frequently appeared coded words."
    )
    prefix = "According to the coded text above, the three most frequently appeared words are:"
    words_rng = rng("words")
    vocab = _distinct(lambda: _pseudo_word(words_rng), _FWE_VOCAB)
    echo = f"{intro} {question} {prefix} answer briefly with just the three words"
    top = _unambiguous(vocab, _inside_others(tuple(vocab)), echo, 3)
    ranked = top + [word for word in vocab if word not in top]
    counts = _zipf_counts(n + _FWE_MIN_WORDS, len(ranked), _FWE_ALPHA)
    items = [word for word, count in zip(ranked, counts) for _ in range(count)]
    rng("order").shuffle(items)
    text = "\n".join(" ".join(items[i : i + 16]) for i in range(0, len(items), 16))
    prompt = f"{intro}\nQuestion: {question}\n\n{text}\n\nQuestion: {question} Answer briefly with just the three words."
    return _Parts(prompt, question, top, prefix)


# QA: facts about fictional entities, each entity named once in the document.
_ONSETS = ("b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou")
_CODAS = ("", "", "", "", "n", "r", "l", "s", "m", "th")


def _syllables(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(count))


def _country(rng: random.Random) -> str:
    return _cap(_syllables(rng, 2) + rng.choice(("ia", "land", "mark", "ovia", "ara", "istan")))


def _city(rng: random.Random) -> str:
    return _cap(_syllables(rng, 2) + rng.choice(("", "", "burg", "ford", "ova", "heim", "port")))


def _person(rng: random.Random) -> str:
    return f"{_cap(_syllables(rng, 2))} {_cap(_syllables(rng, 2))}"


def _company(rng: random.Random) -> str:
    kind = rng.choice(("Industries", "Works", "Labs", "Trading Company", "Mills", "Shipping"))
    return f"{_cap(_syllables(rng, 2))} {kind}"


def _title(rng: random.Random) -> str:
    return f"The {_cap(rng.choice(_ADJECTIVES))} {_cap(rng.choice(_NOUNS))} of {_cap(_syllables(rng, 2))}"


# relation -> (fact, question, [(slot, generator, unique)]); the answer is the last slot.
_RELATIONS: dict[str, tuple[str, str, tuple[tuple[str, Callable[[random.Random], str], bool], ...]]] = {
    "capital": ("The capital of {a} is {b}.", "What is the capital of {a}?", (("a", _country, True), ("b", _city, True))),
    "founder": ("{a} was founded by {b}.", "Who founded {a}?", (("a", _company, True), ("b", _person, True))),
    "author": ('The novel "{a}" was written by {b}.', 'Who wrote the novel "{a}"?', (("a", _title, True), ("b", _person, True))),
    "mayor": ("The mayor of {a} is {b}.", "Who is the mayor of {a}?", (("a", _city, True), ("b", _person, True))),
    "birthplace": ("{a} was born in {b}.", "In which city was {a} born?", (("a", _person, True), ("b", _city, True))),
    "animal": (
        "The national animal of {a} is the {b}.",
        "What is the national animal of {a}?",
        (("a", _country, True), ("b", lambda r: r.choice(_ANIMALS), False)),
    ),
    "profession": (
        "{a} works as a {b}.",
        "What is the profession of {a}?",
        (("a", _person, True), ("b", lambda r: r.choice(_PROFESSIONS), False)),
    ),
    "river": (
        "The {a} River flows through the city of {b}.",
        "Which city does the {a} River flow through?",
        (("a", lambda r: _cap(_syllables(r, 2)), True), ("b", _city, True)),
    ),
}
_RELATION_NAMES = tuple(_RELATIONS)


def _fact(rng: random.Random, relation: str, taken: set[str], avoid: Sequence[str] = ()) -> tuple[str, str, str, str]:
    """``(fact, question, answer, lead)`` with fresh names: none in ``taken`` (which is updated),
    none containing a string of ``avoid`` (the gold fact's names, so no distractor name holds them).
    ``lead`` is the fact up to its answer ("The capital of Verlandia is")."""
    template, question, slots = _RELATIONS[relation]
    values: dict[str, str] = {}
    for slot, make, unique in slots:
        while True:
            value = make(rng)
            low = value.lower()
            if not unique or (low not in taken and not any(bad in low for bad in avoid)):
                break
        if unique:
            taken.add(low)
        values[slot] = value
    answer_slot = slots[-1][0]
    lead = template[: template.index("{" + answer_slot + "}")].rstrip().format(**values)
    return template.format(**values), question.format(**values), values[answer_slot], lead


def _build_qa(rng: RngFactory, n: int, length: int) -> _Parts:
    gold_rng = rng("gold")
    relation = gold_rng.choice(_RELATION_NAMES)
    taken: set[str] = set()
    gold_fact, question, answer, lead = _fact(gold_rng, relation, taken)
    depth = gold_rng.random()
    facts_rng = rng("facts")
    # Distractors of every relation, the question's own among them (about 1 in 8).
    avoid = sorted(taken)  # the gold fact's names
    facts = [
        _fact(facts_rng, facts_rng.choice(_RELATION_NAMES), taken, avoid)[0]
        for _ in range(n)
    ]
    facts = _insert(facts, [(depth, gold_fact)])
    instruction = "Answer the question based on the given document. Only give me the answer and do not output any other words."
    prompt = (
        f"{instruction}\nQuestion: {question}\n\nThe following is the given document.\n\n{_paragraphs(facts, 5)}\n\n"
        f"{instruction}\n\nQuestion: {question} Answer briefly."
    )
    return _Parts(prompt, question, [answer], f"Answer: {lead}")


# ----------------------------------------------------------------------------------------------
# Registry and sample generation
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A task: its name, the RULER metric that scores it, its builder, and how many tokens to generate."""

    name: str
    metric: str
    description: str
    build: Callable[[RngFactory, int, int], _Parts]
    max_new_tokens: int = 32
    """Enough new tokens for a complete answer (SmolLM2 spends one token per digit)."""


_ALL, _PART = "string_match_all", "string_match_part"
TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("niah_single", _ALL, "one needle (key, 7-digit number) in filler; give the number", _build_niah_single),
        Task("niah_multikey", _ALL, "the target needle among 3 distractor keys; give its number", _build_niah_multikey),
        Task("niah_multivalue", _ALL, "one key with 4 numbers at 4 depths; give all 4", _build_niah_multivalue, 64),
        Task("niah_multiquery", _ALL, "4 keys asked at once; give all 4 numbers", _build_niah_multiquery, 64),
        Task("variable_tracking", _ALL, "a 4-hop chain of VAR assignments; name all 5", _build_variable_tracking, 64),
        Task("common_words", _ALL, f"a word list; give the {_CWE_TOP_K} most common words", _build_common_words, 48),
        Task("frequent_words", _ALL, "Zipf-distributed coded words; give the 3 most frequent", _build_frequent_words),
        Task("qa", _PART, "facts about fictional entities; answer one question", _build_qa),
    )
}


def get_task(name: str) -> Task:
    """The task named ``name``; ``UnknownNameError`` (a ``ConfigError``) lists the known ones."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise UnknownNameError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def _rng_factory(task: str, seed: int) -> RngFactory:
    # String seeds are hashed with SHA-512: the same on every run and platform, whatever PYTHONHASHSEED.
    return lambda stream: random.Random(f"kvpolicy.eval/{task}/{seed}/{stream}")


def _fit(tokens_at: Callable[[int], int], length: int, describe: str) -> int:
    """The largest ``n`` with ``tokens_at(n) <= length``, for ``tokens_at`` (nearly) increasing in ``n``."""
    base = tokens_at(0)
    if base > length:
        raise ConfigError(f"{describe}: length {length} is too small; the prompt without filler already takes {base} tokens")
    limit = 4 * length + 16  # every unit of filler is at least one token
    # Two secant steps from a small probe, then a bracket and a bisection.
    guess = 16
    for _ in range(2):
        grown = tokens_at(guess) - base
        guess = min(limit, max(1, int(guess * (length - base) / max(grown, 1))))
    step = max(1, guess // 100)
    if tokens_at(guess) <= length:
        lo, hi = guess, guess + step
        while hi < limit and tokens_at(hi) <= length:
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit)
        if tokens_at(hi) <= length:
            raise ConfigError(f"{describe}: the prompt does not grow with its filler; cannot reach {length} tokens")
    else:
        lo, hi = max(0, guess - step), guess
        while lo > 0 and tokens_at(lo) > length:
            hi, step = lo, step * 2
            lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens_at(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def _as_int(value: Any, what: str) -> int:
    """``value`` as a plain int (numpy integers too); not a bool, a float or a string."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    return operator.index(value)


def make_sample(task: str, tokenizer: Any, length: int, seed: int = 0) -> Sample:
    """Generate one ``task`` sample whose chat-templated prompt just fits in ``length`` tokens.

    The same ``(task, length, seed)`` and tokenizer always give the same sample. The prompt
    (``build_chat``'s output, answer prefix included) has between ``(1 - TOLERANCE) * length``
    and ``length`` tokens; keep ``length`` within the model's context. Raises ``ConfigError`` for
    an unknown task (listing the known ones) or a ``length`` too small to hold the task.
    """
    spec = get_task(task)
    length = _as_int(length, "length")
    if length < 1:
        raise ConfigError(f"length must be a positive number of tokens, got {length!r}")
    seed = _as_int(seed, "seed")
    rng = _rng_factory(task, seed)
    built: dict[int, Sample] = {}

    def sample_at(n: int) -> Sample:
        if n not in built:
            parts = spec.build(rng, n, length)
            sample = Sample(task, parts.prompt, parts.answers, length, seed, parts.question, parts.answer_prefix)
            sample.tokens = count_tokens(tokenizer, sample)
            built[n] = sample
        return built[n]

    n = _fit(lambda n: sample_at(n).tokens, length, f"task {task!r}")
    return sample_at(n)


def make_samples(
    tokenizer: Any, length: int, seeds: Iterable[int] = (0, 1, 2), tasks: Iterable[str] | None = None
) -> list[Sample]:
    """One sample per task (all of ``TASKS`` by default) and seed, task-major."""
    names = list(TASKS) if tasks is None else list(tasks)
    for name in names:
        get_task(name)
    seeds = list(seeds)
    return [make_sample(name, tokenizer, length, seed) for name in names for seed in seeds]
