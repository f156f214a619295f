"""Shared fixtures: tiny random-config decoder models of each supported family, and prompts.

Every model is float32, in eval mode and built under a fixed seed, so two builds of the same
family are identical; generation never stops at eos. Shapes: hidden 64, 2 layers, 4 query
heads over 2 KV heads (GQA), head_dim 16, vocab 128, room for 1024 positions.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import transformers

# Triton kernels are tested on CPU through its interpreter, which Triton reads when a kernel
# is decorated, so it must be on before kvpolicy's Triton ops are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_per_kernel() -> None:
    """Triton's interpreter patches ``triton.language`` for a kernel's launch, then again at every call of a
    ``@triton.jit`` helper inside it (``tl.sort``'s compare-and-swap steps are such helpers): each time it walks
    every member of the language's modules, about 4 ms, so helper-heavy kernels spent a third of their CI time
    there (cProfile, session 40). A helper's patch is never undone and changes nothing on modules already patched,
    so it is skipped where every language module the helper sees is patched already."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope") or getattr(original, "once", False):
        return

    def patch_lang(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and all(lang.static_print is print for lang in langs):  # the patch sets static_print to print
            return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.once = True
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_kernel()


def _share_the_cores_among_workers() -> None:
    """Under xdist each worker takes its share of the cores as torch's intra-op threads. By default every worker
    takes them all, and on CI's 2 cores the two workers' threads spin against each other: the eval slice's grid
    took 383 s in a 2-worker run of the suite, and 139 s with a thread a worker (the whole run: 10:18 to 6:45 on a
    2-core machine, session 41)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores_among_workers()

VOCAB = 128
PAD_ID = 0
PAD_TOKENS = 7  # left padding of row 1 in `left_padded_batch`

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=PAD_ID,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # family -> (config class, model class, extra config options)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def build_model(family: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A tiny random ``family`` model (see ``FAMILIES``); ``overrides`` change config fields."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return _finish(model)


def _finish(model):
    # random weights emit eos at random; generation always runs max_new_tokens
    model.generation_config.eos_token_id = None
    return model.float().eval()


def build_from_config(config: transformers.PretrainedConfig, model_cls: type, seed: int = 0):
    """A random model of ``model_cls`` from an explicit ``config`` (hybrid and unsupported models)."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return _finish(model_cls(config))


def random_prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    """``(batch, length)`` token ids, avoiding the pad/bos/eos ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def left_padded_batch(length: int, pad: int = PAD_TOKENS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 prompts of ``length`` columns; row 1 is left-padded by ``pad`` tokens.

    Returns ``(input_ids, attention_mask)``; the mask is 0 on the padding.
    """
    ids = random_prompt(length, batch=2, seed=seed)
    mask = torch.ones_like(ids)
    ids[1, :pad] = PAD_ID
    mask[1, :pad] = 0
    return ids, mask


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module: tiny models gain nothing from more, and on a
    shared 2-core CI machine extra threads spin against each other (10x slower seen)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., transformers.PreTrainedModel]:
    """Builds (and caches per session) one tiny model per family; treat the models as read-only."""
    built: dict[str, transformers.PreTrainedModel] = {}

    def get(family: str) -> transformers.PreTrainedModel:
        if family not in built:
            built[family] = build_model(family)
        return built[family]

    return get


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(tiny_model_factory, family) -> transformers.PreTrainedModel:
    return tiny_model_factory(family)


@pytest.fixture
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_batch(40)


# The benchmark scripts are files, not a package (tests/benchmarks/ has no conftest of its own: a
# second module named conftest would shadow this one for the tests that import from it).
_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], Any]:
    """``benchmark_script(name)``: ``benchmarks/<name>.py`` imported as a module (anew each call)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCHMARKS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def prompt_query(batch: int, q_heads: int, dim: int, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> torch.Tensor:
    """A prompt's last query ``(batch, q_heads, dim)`` for a layer prefilled by hand: what a policy with
    ``first_selection="prompt"`` (the louiskv preset's) selects from. Drawn from its own generator, so
    a test's other draws stay as they were."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, q_heads, dim, generator=gen).to(device, dtype)


@pytest.fixture
def pools_as_on_a_gpu(monkeypatch):
    """Stores whose pool shares their attention device are set up as a GPU pool's are (``from_prefill``
    does it on a GPU only): read whole at a re-selection (``read_whole``) and attended by slot where
    ``store.attends_pool_by_slot`` says (an every-step policy's), so the CPU tests run those paths too."""
    from kvpolicy import store as store_module
    from kvpolicy.store import TieredStore

    made = TieredStore.from_prefill.__func__

    def as_on_a_gpu(cls, *args, reselects_every_step=False, **kwargs):
        store = made(cls, *args, reselects_every_step=reselects_every_step, **kwargs)
        on_device = store.pool.keys.device == store.retrieved.keys.device
        store.read_whole = on_device
        store.attend_pool = on_device and store_module.attends_pool_by_slot(reselects_every_step)
        return store

    monkeypatch.setattr(TieredStore, "from_prefill", classmethod(as_on_a_gpu))


@pytest.fixture
def pools_attended_by_slot(monkeypatch, pools_as_on_a_gpu):
    """Stores set up as a GPU pool's are (``pools_as_on_a_gpu``), attended by slot as an every-step
    policy's are, here for every policy (``store.ATTEND_POOL_BY_SLOT = True``), so the CPU tests run
    that path with every policy."""
    from kvpolicy import store

    monkeypatch.setattr(store, "ATTEND_POOL_BY_SLOT", True)
