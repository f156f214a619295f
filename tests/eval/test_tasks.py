"""RULER-style synthetic tasks (kvpolicy.eval.tasks): determinism, sizing, answers, scoring.

Runs offline with a tiny byte-level BPE tokenizer trained here on the tasks' own text; the
SmolLM2 tokenizer is also checked when its converted copy is cached locally (skipped otherwise).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from kvpolicy.errors import ConfigError
from kvpolicy.eval.tasks import (
    TASKS,
    TOLERANCE,
    Sample,
    build_chat,
    chat_text,
    make_sample,
    make_samples,
    score,
    string_match_all,
    string_match_part,
)

ALL_TASKS = [
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
    "qa",
]
NIAH = [name for name in ALL_TASKS if name.startswith("niah")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for name, task in TASKS.items():
        rng = lambda stream, name=name: random.Random(f"test-corpus/{name}/{stream}")  # noqa: E731
        corpus.append(task.build(rng, 40, 1000).prompt)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tok():
    return _train_tokenizer(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tok():
    return _train_tokenizer(None)


@pytest.fixture(scope="module")
def samples(tok):
    """Two seeds of every task at 2048 tokens, made once."""
    return {(name, seed): make_sample(name, tok, 2048, seed) for name in ALL_TASKS for seed in (0, 1)}


def test_registry_names_and_metrics():
    assert list(TASKS) == ALL_TASKS
    for name, task in TASKS.items():
        assert task.name == name
        assert task.metric == ("string_match_part" if name == "qa" else "string_match_all")


@pytest.mark.parametrize("name", ALL_TASKS)
def test_same_seed_same_sample_other_seed_other_sample(tok, samples, name):
    again = make_sample(name, tok, 2048, 0)
    assert again == samples[(name, 0)]
    other = samples[(name, 1)]
    assert other.prompt != again.prompt
    assert other.answers != again.answers
    assert (again.task, again.length, again.seed, other.seed) == (name, 2048, 0, 1)


@pytest.mark.parametrize("length", [1024, 2048, 4096])
@pytest.mark.parametrize("name", ALL_TASKS)
def test_chat_prompt_fills_length_within_tolerance(tok, name, length):
    sample = make_sample(name, tok, length, seed=3)
    inputs = build_chat(tok, sample)
    n = inputs["input_ids"].shape[1]
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (1, n)
    assert int(inputs["attention_mask"].sum()) == n
    assert (1 - TOLERANCE) * length <= n <= length
    assert sample.tokens == n


def test_plain_text_fallback_without_chat_template(plain_tok):
    sample = make_sample("niah_single", plain_tok, 1024, seed=0)
    text = chat_text(plain_tok, sample)
    assert text.startswith(sample.prompt) and text.endswith(sample.answer_prefix)
    n = build_chat(plain_tok, sample)["input_ids"].shape[1]
    assert (1 - TOLERANCE) * 1024 <= n <= 1024 == sample.length


def test_chat_layout(tok, samples):
    sample = samples[("niah_single", 0)]
    text = chat_text(tok, sample)
    assert text.startswith("<|im_start|>user\n" + sample.prompt)
    assert text.endswith("<|im_start|>assistant\n" + sample.answer_prefix)
    bare = chat_text(tok, sample, answer_prefix=False)
    assert bare.endswith("<|im_start|>assistant\n")
    # The question is stated before the haystack and again after it.
    assert sample.prompt.count(sample.question) == 2
    assert sample.prompt.index(sample.question) < 300


@pytest.mark.parametrize("name", ALL_TASKS)
def test_question_and_answer_prefix_do_not_give_the_answers_away(samples, name):
    for seed in (0, 1):
        sample = samples[(name, seed)]
        echo = (sample.question + " " + sample.answer_prefix).lower()
        assert sample.answer_prefix and not any(answer.lower() in echo for answer in sample.answers)
        assert TASKS[name].max_new_tokens >= 32


@pytest.mark.parametrize("name", NIAH)
def test_niah_needles_hold_the_answers(samples, name):
    for seed in (0, 1):
        sample = samples[(name, seed)]
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", sample.prompt)
        asked = re.findall(r"[a-z]+-[a-z]+", sample.question)
        expected = [value for key, value in needles if key in asked]
        assert sorted(sample.answers) == sorted(expected)
        counts = {"niah_single": (1, 1, 1), "niah_multikey": (4, 1, 1), "niah_multivalue": (4, 1, 4), "niah_multiquery": (4, 4, 4)}
        n_needles, n_asked, n_answers = counts[name]
        assert (len(needles), len(set(asked)), len(sample.answers)) == (n_needles, n_asked, n_answers)
        assert len({value for _, value in needles}) == len(needles)
        for answer in sample.answers:
            assert sample.prompt.count(answer) == 1


def test_niah_needles_spread_over_depths(tok):
    sample = make_sample("niah_multivalue", tok, 4096, seed=5)
    positions = sorted(sample.prompt.index(answer) / len(sample.prompt) for answer in sample.answers)
    assert positions[-1] - positions[0] > 0.1


def test_variable_tracking_chain_resolves_to_answers(samples):
    for seed in (0, 1):
        sample = samples[("variable_tracking", seed)]
        value = re.search(r"assigned the value (\d+)", sample.question).group(1)
        assignments = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", sample.prompt)
        resolved = {}
        for name, source in assignments:  # statements come in chain order
            resolved[name] = resolved[source[4:]] if source.startswith("VAR ") else source
        holding = sorted(name for name, got in resolved.items() if got == value)
        assert holding == sorted(sample.answers)
        assert len(sample.answers) == 5


def _listed_words(sample: Sample) -> list[str]:
    return re.findall(r"^\d+\. ([a-z]+)$", sample.prompt, flags=re.MULTILINE)


@pytest.mark.parametrize("length", [1024, 4096])
def test_common_words_answers_are_the_most_common(tok, length):
    sample = make_sample("common_words", tok, length, seed=2)
    counts = Counter(_listed_words(sample))
    k = len(sample.answers)
    assert k == 5 and f"{k} most common" in sample.question
    top = {word for word, _ in counts.most_common(k)}
    assert top == set(sample.answers)
    rest = max(count for word, count in counts.items() if word not in top)
    assert min(counts[word] for word in sample.answers) >= 3 * rest


def _coded_words(sample: Sample) -> list[str]:
    body = sample.prompt.split("\n\n")[1]
    return body.split()


@pytest.mark.parametrize("length", [1024, 4096])
def test_frequent_words_answers_are_the_three_most_frequent(tok, length):
    sample = make_sample("frequent_words", tok, length, seed=2)
    counts = Counter(_coded_words(sample))
    ranked = counts.most_common()
    assert len(sample.answers) == 3
    assert {word for word, _ in ranked[:3]} == set(sample.answers)
    assert ranked[2][1] > ranked[3][1]  # the 3rd is strictly above the 4th
    assert all(re.fullmatch(r"[a-z]+", word) for word in counts)


QA_QUESTIONS = [
    r"What is the capital of (.+)\?",
    r"Who founded (.+)\?",
    r'Who wrote the novel "(.+)"\?',
    r"Who is the mayor of (.+)\?",
    r"In which city was (.+) born\?",
    r"What is the national animal of (.+)\?",
    r"What is the profession of (.+)\?",
    r"Which city does the (.+) River flow through\?",
]


def test_qa_answer_is_in_exactly_one_fact(tok):
    relations = set()
    for seed in range(8):
        sample = make_sample("qa", tok, 1024, seed)
        (answer,) = sample.answers
        matches = [re.fullmatch(pattern, sample.question) for pattern in QA_QUESTIONS]
        (index,) = [i for i, match in enumerate(matches) if match]
        relations.add(index)
        subject = matches[index].group(1)
        document = sample.prompt.split("The following is the given document.")[1].split("Answer the question")[0]
        facts = [fact for fact in re.split(r"(?<=\.) |\n", document) if subject in fact]
        assert len(facts) == 1 and answer in facts[0], (sample.question, facts)
    assert len(relations) >= 3  # the question varies across seeds


def test_make_samples_covers_tasks_and_seeds(tok):
    made = make_samples(tok, 1024, seeds=(0, 1), tasks=["qa", "niah_single"])
    assert [(s.task, s.seed) for s in made] == [("qa", 0), ("qa", 1), ("niah_single", 0), ("niah_single", 1)]


def test_scoring_examples():
    answers = ["1234567", "7654321", "1111111", "2222222"]
    assert score("niah_multivalue", "They are 1234567, 7654321, 1111111 and 2222222.", answers) == 100.0
    assert score("niah_multivalue", "1234567 and 7654321", answers) == 50.0
    assert score("niah_multivalue", "I don't know.", answers) == 0.0
    assert score("variable_tracking", "qwpia, WKGBO", ["QWPIA", "WKGBO", "YVXDG", "HYXXH"]) == 50.0
    assert score("common_words", "Apple, PEAR", ["apple", "pear", "plum"]) == pytest.approx(200 / 3)
    assert score("qa", "It was Dorel Vantis.", ["Dorel Vantis", "Vantis"]) == 100.0
    assert score("qa", "Vantis", ["Dorel Vantis", "Vantis"]) == 100.0
    assert score("qa", "Nobody", ["Dorel Vantis", "Vantis"]) == 0.0
    assert string_match_all("abc", ["a", "z"]) == 50.0
    assert string_match_part("abc", ["y", "z"]) == 0.0
    assert score("niah_single", "x", "x") == 100.0  # a bare string is one answer


def test_sample_metric(samples):
    assert samples[("qa", 0)].metric == "string_match_part"
    assert samples[("niah_single", 0)].metric == "string_match_all"


def test_unknown_task_lists_known_tasks(tok):
    for call in (lambda: make_sample("niah_double", tok, 1024, 0), lambda: score("niah_double", "x", ["x"])):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "niah_double" in message and all(name in message for name in ALL_TASKS)


def test_bad_lengths_raise_config_error(tok):
    with pytest.raises(ConfigError, match="too small"):
        make_sample("niah_single", tok, 50, 0)
    for bad in (0, -5, 1024.0, True):
        with pytest.raises(ConfigError, match="length"):
            make_sample("niah_single", tok, bad, 0)
    with pytest.raises(ConfigError, match="seed"):
        make_sample("niah_single", tok, 1024, "0")
    with pytest.raises(ConfigError):
        score("qa", "x", [])


def test_numpy_integers_are_accepted(tok):
    np = pytest.importorskip("numpy")
    sample = make_sample("qa", tok, np.int64(1024), np.int32(4))
    assert sample == make_sample("qa", tok, 1024, 4)
    assert type(sample.length) is int and type(sample.seed) is int


def _cached_smollm2_tokenizer():
    from kvpolicy.models import cache_dir

    path = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the converted SmolLM2 is not cached locally")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_smollm2_tokenizer_sizes_within_tolerance():
    tokenizer = _cached_smollm2_tokenizer()
    cases = [(name, 2048) for name in ALL_TASKS] + [("niah_multivalue", 8192), ("qa", 8192)]
    for name, length in cases:
        sample = make_sample(name, tokenizer, length, seed=0)
        n = build_chat(tokenizer, sample)["input_ids"].shape[1]
        assert (1 - TOLERANCE) * length <= n <= length, (name, length, n)
        if name not in ("common_words", "frequent_words"):
            assert all(answer in sample.prompt for answer in sample.answers)
