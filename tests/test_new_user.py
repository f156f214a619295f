"""What a new user trips over (issue 15, items 4, 5 and 7): eval's resume keyed by everything that
decides a cell, one-line errors before the model loads, and the smaller ones.

Offline: a tiny random Llama and a byte-level BPE tokenizer trained here on the tasks' text.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest
import torch
import transformers

import kvpolicy
from kvpolicy import cli
from kvpolicy.errors import ConfigError
from kvpolicy.eval import runner
from kvpolicy.eval.runner import RESULTS, load_results, run_grid
from kvpolicy.eval.tasks import TASKS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LENGTH, BUDGET = 300, 96
GRID = dict(tasks=["niah_single"], lengths=[LENGTH], budgets=[BUDGET], seeds=[0], progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [task.build(lambda stream, n=name: random.Random(f"new-user/{n}/{stream}"), 40, 1000).prompt
              for name, task in TASKS.items()]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                               eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(tokenizer, seed: int = 0, **overrides):
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(tokenizer)


# --- item 4: eval resumes with the right results -------------------------------------------------------


def test_rows_record_the_model_and_the_policy_spec(model, tokenizer, tmp_path):
    cells = run_grid(model, tokenizer, out_dir=tmp_path, presets=["streaming"], model_name="tiny-a", **GRID)
    (row,) = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert row["model"] == "tiny-a"
    assert row["policy"]["budget"] == BUDGET and row["policy"]["local"] == BUDGET - 4
    assert row["policy"]["placement"] == "cpu" and "name" not in row["policy"]
    assert [c.model for c in cells] == ["tiny-a"]


def test_a_variant_rerun_with_other_options_runs_again(model, tokenizer, tmp_path):
    def grid(tau):
        variants = {"lk": ("louiskv", {"trigger": {"name": "query_cosine", "tau": tau}})}
        return run_grid(model, tokenizer, out_dir=tmp_path, presets=["lk"], variants=variants, model_name="tiny",
                        **GRID)

    (first,) = grid(0.5)
    (second,) = grid(0.9)
    assert second.policy["trigger"]["tau"] == 0.9  # not the 0.5 cell reused
    assert len(load_results(tmp_path / RESULTS)) == 2
    (again,) = grid(0.9)  # the same options: resumed, not recomputed
    assert again.seconds == second.seconds
    assert len((tmp_path / RESULTS).read_text().splitlines()) == 2


def test_a_folder_of_another_models_results_is_refused_unless_added_to(model, tokenizer, tmp_path):
    run_grid(model, tokenizer, out_dir=tmp_path, presets=["streaming"], model_name="smollm2", **GRID)
    other = tiny_llama(tokenizer, seed=1)
    with pytest.raises(ConfigError, match=r"holds results of another model \(smollm2\), not of 'random'.*--add-model"):
        run_grid(other, tokenizer, out_dir=tmp_path, presets=["streaming"], model_name="random", **GRID)
    cells = run_grid(other, tokenizer, out_dir=tmp_path, presets=["streaming"], model_name="random",
                     add_model=True, **GRID)
    assert [c.model for c in cells] == ["random"]  # its own cell, run, not smollm2's reused
    rows = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert [r["model"] for r in rows] == ["smollm2", "random"]


def test_rows_without_a_model_are_another_models(tmp_path):
    row = dict(task="niah_single", length=LENGTH, seed=0, preset="full", budget=None, score=100.0, prediction="x",
               reselect_share=None, recall=1.0, recall_per_layer={}, seconds=1.0)
    (tmp_path / RESULTS).write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="not recorded"):
        runner.check_out_dir(tmp_path, "smollm2")


def test_a_torn_last_line_is_skipped_with_a_note_and_cut_before_appending(model, tokenizer, tmp_path, capsys):
    (first,) = run_grid(model, tokenizer, out_dir=tmp_path, presets=["streaming"], model_name="tiny", **GRID)
    path = tmp_path / RESULTS
    whole = path.read_text()
    path.write_text(whole + whole[: len(whole) // 2])  # a second write cut short
    capsys.readouterr()
    cells = run_grid(model, tokenizer, out_dir=tmp_path, presets=["streaming", "full"], model_name="tiny", **GRID)
    assert "skipped its last line, cut short by an interrupted write" in capsys.readouterr().err
    assert sorted(c.preset for c in cells) == ["full", "streaming"]
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    assert [c.seconds for c in cells if c.preset == "streaming"] == [first.seconds]


def test_a_bad_line_before_the_last_names_its_line(tmp_path):
    (tmp_path / RESULTS).write_text("{not json\n{}\n")
    with pytest.raises(ConfigError, match="line 1 is not an eval result"):
        load_results(tmp_path / RESULTS)


def test_out_naming_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(ConfigError, match="is a file; name a folder"):
        runner.check_out_dir(target, "smollm2")


def test_model_identity_names_the_embedded_model_and_resolves_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    embedded = tmp_path / "models" / "smollm2-135m-instruct"
    embedded.mkdir(parents=True)
    assert runner.model_identity("smollm2") == "smollm2"
    assert runner.model_identity(str(embedded)) == "smollm2"
    monkeypatch.chdir(tmp_path)
    assert runner.model_identity("models") == str(tmp_path.resolve() / "models")
