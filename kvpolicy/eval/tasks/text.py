"""The pieces the families write with: small embedded word lists (nothing is downloaded), the
filler grammar of the needle and tracking haystacks, and placing, numbering and paragraphing."""

from __future__ import annotations

import random
from typing import Callable, Sequence

ADJECTIVES = sorted(set("""
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

NOUNS = sorted(set("""
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

VERBS = sorted(set("""
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

ANIMALS = sorted(set("""
badger beaver bison bobcat buffalo camel cheetah cobra condor coyote crane deer dingo donkey eagle
elk falcon ferret flamingo gazelle gecko giraffe hedgehog heron hyena ibis iguana jackal jaguar
kangaroo koala lemur leopard llama lynx marmot meerkat mole moose narwhal ocelot okapi opossum
orca osprey otter panther pelican porcupine puffin raccoon reindeer salamander seal stork tapir
toucan walrus weasel wolverine yak
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


def cap(text: str) -> str:
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
        return f"{cap(subject)} {verb} {obj} {tail}, and {other} {rng.choice(_PAST_VERBS)} {rng.choice(_OBJECTS)}."
    return f"{cap(subject)} {verb} {obj} {tail}."


def filler(rng: random.Random, n: int) -> list[str]:
    """``n`` filler sentences; the same stream gives the same prefix for any ``n``."""
    return [_filler_sentence(rng) for _ in range(n)]


def insert(sentences: list[str], needles: Sequence[tuple[float, str]]) -> list[str]:
    """Insert each ``(depth, text)`` at ``depth`` (0 = start, 1 = end) of ``sentences``; order of equal depths kept."""
    out = list(sentences)
    n = len(sentences)
    # Insert deepest first so earlier indices stay valid; stable for ties (reverse of input order).
    placed = sorted(enumerate(needles), key=lambda item: (item[1][0], item[0]), reverse=True)
    for _, (depth, text) in placed:
        out.insert(round(depth * n), text)
    return out


def paragraphs(sentences: Sequence[str], per: int = 6) -> str:
    return "\n".join(" ".join(sentences[i : i + per]) for i in range(0, len(sentences), per))


def number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def distinct(make: Callable[[], str], count: int, taken: set[str] | None = None) -> list[str]:
    taken = set() if taken is None else taken
    out: list[str] = []
    while len(out) < count:
        value = make()
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out
