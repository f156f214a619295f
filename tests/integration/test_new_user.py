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
from kvpolicy.cli import eval as eval_cli
from kvpolicy.cli.common import check_writable
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
    config = transformers.LlamaConfig(**{**dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False), **overrides})
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


def test_the_summary_never_averages_two_models():
    from kvpolicy.eval.report import summarize, table

    def cell(model, score):
        return runner.CellResult(task="niah_single", length=LENGTH, seed=0, preset="full", budget=None, score=score,
                                 prediction="", reselect_share=None, recall=1.0, recall_per_layer={}, seconds=1.0,
                                 model=model, policy={})

    rows = summarize([cell("smollm2", 100.0), cell("/models/random", 0.0)])
    assert sorted((r["model"], r["score"]) for r in rows) == [("/models/random", 0.0), ("smollm2", 100.0)]
    assert "| smollm2 | 300 | all | full | 100.0 |" in table(rows)
    assert table(rows[:1]).startswith("| length |")  # one model: no model column


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


# --- item 5: one-line errors, exit 2, before the model loads ---------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every check below must come before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("kvpolicy.models.load_model", load_model)


def refused(argv, capsys) -> str:
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    lines = err.splitlines()  # notes may come first; the error is the last line, and one line
    assert lines and lines[-1].startswith("kvpolicy: error: ") and err.count("error:") == 1, err
    assert "Traceback" not in err
    return lines[-1]


def test_a_binary_prompt_file_is_refused(tmp_path, no_model, capsys):
    binary = tmp_path / "doc.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert "is not UTF-8 text (byte 0x89 at offset 0)" in refused(
        ["run", "--preset", "quest", "--prompt-file", str(binary)], capsys)


def test_an_empty_prompt_file_is_refused(tmp_path, no_model, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n")
    assert "is empty" in refused(["run", "--preset", "quest", "--prompt-file", str(empty)], capsys)


@pytest.mark.parametrize("command", [["run", "--preset", "quest"], ["fidelity"], ["drift"], ["bench", "layer", "--backend", "reference"]])
def test_an_unwritable_json_is_refused_before_the_run(tmp_path, no_model, capsys, command):
    missing = tmp_path / "no-such-folder" / "out.json"
    assert "--json" in refused([*command, "--json", str(missing)], capsys)
    assert "is a folder" in refused([*command, "--json", str(tmp_path)], capsys)
    assert not missing.parent.exists()


def test_an_existing_json_is_not_touched_by_the_check(tmp_path):
    target = tmp_path / "figures.json"
    target.write_text("[1]")
    check_writable(str(target), "--json")
    assert target.read_text() == "[1]"
    check_writable(str(tmp_path / "new.json"), "--json")
    assert not (tmp_path / "new.json").exists()


def test_eval_out_naming_a_file_is_refused_before_the_model_loads(tmp_path, no_model, capsys):
    target = tmp_path / "results"
    target.write_text("")
    assert "is a file; name a folder" in refused(["eval", "--out", str(target)], capsys)


def test_eval_into_another_models_folder_is_refused_unless_add_model(tmp_path, no_model, capsys):
    row = dict(task="niah_single", length=LENGTH, seed=0, preset="full", budget=None, score=100.0, prediction="x",
               reselect_share=None, recall=1.0, recall_per_layer={}, seconds=1.0, model="/models/other", policy={})
    (tmp_path / RESULTS).write_text(json.dumps(row) + "\n")
    err = refused(["eval", "--out", str(tmp_path), "--model", "smollm2"], capsys)
    assert "another model (/models/other), not of 'smollm2'" in err and "--add-model" in err
    with pytest.raises(AssertionError, match="model was loaded"):  # past the check: it loads the model
        cli.main(["eval", "--out", str(tmp_path), "--model", "smollm2", "--add-model"])


def test_from_dict_of_a_list_is_a_config_error():
    with pytest.raises(ConfigError, match=r"a policy config is a mapping.*got list \[1, 2\]; fields: admit, backend"):
        kvpolicy.Policy.from_dict([1, 2])


# --- item 7: the smaller ones ---------------------------------------------------------------------------


def test_describe_names_placement_and_backend():
    text = kvpolicy.preset("quest", placement="gpu", backend="reference").describe()
    assert "placement=gpu" in text and "backend=reference" in text
    assert "placement=cpu, backend=auto" in kvpolicy.preset("streaming").describe()


@pytest.mark.parametrize("flags", [["--placement", "gpu"], ["--backend", "reference"]])
def test_preset_full_with_placement_or_backend_is_refused(no_model, capsys, flags):
    assert "apply only to retrieval presets, not to --preset full" in refused(["run", "--preset", "full", *flags],
                                                                              capsys)


def test_placement_gpu_without_cuda_is_refused_before_the_model_loads(no_model, capsys):
    assert "--placement gpu keeps the full KV in GPU memory, but the model runs on cpu" in refused(
        ["run", "--preset", "quest", "--placement", "gpu", "--device", "cpu"], capsys)


def test_a_prompt_past_max_position_embeddings_warns(tokenizer, tmp_path, monkeypatch, capsys):
    short = tiny_llama(tokenizer, max_position_embeddings=64)
    monkeypatch.setattr("kvpolicy.models.load_model", lambda *a, **k: (short, tokenizer))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog " * 12)
    assert cli.main(["run", "--preset", "full", "--prompt-file", str(prompt), "--max-new-tokens", "2",
                     "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "warning: the prompt plus --max-new-tokens (" in err
    assert "exceeds the model's max_position_embeddings (64)" in err


@pytest.mark.parametrize("positions, warned", [(LENGTH + 31, True), (LENGTH + 32, False)])
def test_eval_warns_when_a_prompt_plus_its_answer_passes_max_position_embeddings(
        tokenizer, tmp_path, monkeypatch, capsys, positions, warned):
    # Gemma 3 270M's "32K" cells: a 32,768-token prompt in a model of 32,768 positions, plus the answer
    # decoded after it (niah_single: 32 tokens), ran past the trained positions without a word
    short = tiny_llama(tokenizer, max_position_embeddings=positions)
    monkeypatch.setattr("kvpolicy.models.load_model", lambda *a, **k: (short, tokenizer))
    assert TASKS["niah_single"].max_new_tokens == 32
    assert cli.main(["eval", "--tasks", "niah_single", "--lengths", str(LENGTH), "--budgets", str(BUDGET),
                     "--presets", "full", "--seeds", "0", "--out", str(tmp_path), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    expected = (f"warning: --lengths {LENGTH} plus a 32-token answer ({LENGTH + 32} tokens) "
                f"exceeds the model's max_position_embeddings ({positions})")
    assert (expected in err) == warned, err


@pytest.mark.parametrize("preset_name", ["louiskv", "streaming"])
def test_kv_on_the_attention_device_never_exceeds_the_full_kv_on_a_short_prompt(
        tokenizer, model, tmp_path, monkeypatch, preset_name):
    # item 3: the README's command on a 43-token prompt printed "3.0 MiB of 2.2 MiB (136%)": the
    # sink and the 64-row ring were allocated whole; they now hold what the tokens can fill
    monkeypatch.setattr("kvpolicy.models.load_model", lambda *a, **k: (model, tokenizer))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("What is the capital of France? Answer in one word.")
    out = tmp_path / "run.json"
    assert cli.main(["run", "--preset", preset_name, "--prompt-file", str(prompt), "--max-new-tokens", "24",
                     "--device", "cpu", "--json", str(out)]) == 0
    (figures,) = [r["figures"] for r in json.loads(out.read_text())]
    assert figures["context_tokens"] < 64  # shorter than the window: the case that overshot
    assert 0 < figures["device_kv_bytes"] <= figures["full_kv_bytes"]


def test_eval_says_at_the_start_that_it_will_draw_no_plots(tmp_path, no_model, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # not installed
    with pytest.raises(AssertionError, match="model was loaded"):
        cli.main(["eval", "--out", str(tmp_path / "out")])
    assert "no plots: matplotlib is not installed (pip install 'kvpolicy[plot]')" in capsys.readouterr().err


def test_louiskv_for_the_embedded_models_name_gets_its_calibrated_tau(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))  # no user calibration file
    from kvpolicy.calibration import BUILTIN_TAU

    # the paper's trigger by name (the model's default is now the calibrated score_gap)
    by_name = kvpolicy.preset("louiskv", model="smollm2", trigger="query_cosine").trigger.tau
    assert by_name == BUILTIN_TAU["smollm2-135m-instruct"] == kvpolicy.preset(
        "louiskv", model="smollm2-135m-instruct", trigger="query_cosine").trigger.tau


@dataclass
class _NotATrigger:
    tau: float = 0.5


def test_registering_a_non_trigger_as_a_trigger_is_refused():
    from kvpolicy.registry import register

    with pytest.raises(ConfigError, match="must subclass kvpolicy.triggers.base.Trigger"):
        register("trigger", "not_a_trigger")(_NotATrigger)
    with pytest.raises(ConfigError, match="must subclass kvpolicy.units.base.UnitBuilder"):
        register("units", "not_units")(_NotATrigger)


def test_registering_the_same_definition_twice_is_no_error():
    from kvpolicy.registry import _REGISTRY

    source = (
        "from dataclasses import dataclass\n"
        "from kvpolicy.registry import register\n"
        "from kvpolicy.triggers.base import Trigger\n"
        "@register('trigger', 'notebook_cell')\n"
        "@dataclass\n"
        "class NotebookCell(Trigger):\n"
        "    pass\n"
    )
    try:
        for _ in range(2):  # a notebook cell run twice
            namespace = {"__name__": "__main__"}
            exec(source, namespace)
        assert kvpolicy.registry.lookup("trigger", "notebook_cell") is namespace["NotebookCell"]
    finally:
        _REGISTRY["trigger"].pop("notebook_cell", None)


def test_the_plugin_readme_variant_command_builds(tmp_path):
    readme = (__import__("pathlib").Path(__file__).parents[2] / "plugins" / "kvpolicy-query-drift" / "README.md").read_text()
    assert "still being written" not in readme
    pytest.importorskip("kvpolicy_query_drift")
    variants = eval_cli.variants(['drift=louiskv:{"trigger": {"name": "query_drift", "tau": 0.8}}'])
    assert run_grid(None, None, out_dir=tmp_path, presets=["full", "louiskv", "drift"], variants=variants,
                    dry_run=True) == []


def test_cli_eval_records_the_model_and_refuses_another_in_its_folder(model, tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kvpolicy.models.load_model", lambda *a, **k: (model, tokenizer))
    grid = ["eval", "--tasks", "niah_single", "--lengths", str(LENGTH), "--budgets", str(BUDGET), "--presets",
            "full,streaming", "--seeds", "0", "--out", str(tmp_path), "--device", "cpu"]
    assert cli.main([*grid, "--model", "smollm2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert [(r["model"], r["preset"]) for r in rows] == [("smollm2", "full"), ("smollm2", "streaming")]
    capsys.readouterr()
    assert "holds results of another model (smollm2)" in refused([*grid, "--model", str(tmp_path / "random")], capsys)
    assert cli.main([*grid, "--model", "smollm2"]) == 0  # resumed: nothing run again
    assert len((tmp_path / RESULTS).read_text().splitlines()) == 2
