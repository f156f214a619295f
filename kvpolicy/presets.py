"""Named policies, each with its documented defaults. Options override any field.

    >>> preset("louiskv", budget=1024).retrieval_budget
    956
"""

from __future__ import annotations

from typing import Any, Callable

import json

from .calibration import DEFAULT_TAU, calibrated_tau, calibration_file, model_id
from .errors import UnknownNameError
from .models import embedded_model_id
from .policy import Policy
from .units.analytic import DEFAULT_UPDATE_BUFFER

DEFAULT_BUDGET = 512
DEFAULT_SINK = 4
DEFAULT_LOCAL = 64
# ``model="smollm2"`` (kvpolicy.models.EMBEDDED_MODEL) is the embedded model, loaded from a copy named EMBEDDED_ID
EMBEDDED_NAME, EMBEDDED_ID = "smollm2", "smollm2-135m-instruct"


def _embedded_id(model: Any) -> Any:
    """``model``, or the id of the embedded model it names (``"smollm2"``, ``"gemma3"``), so a preset
    asked for by name gets what it gets for the loaded model."""
    if isinstance(model, str):
        return embedded_model_id(model) or model
    return model


def _full(**options: Any) -> Policy:
    """Dense attention over the whole cache: the reference every policy is measured against."""
    return Policy(**{"budget": None, "name": "full", **options})


def _streaming(budget: int = DEFAULT_BUDGET, sink: int = DEFAULT_SINK, **options: Any) -> Policy:
    """StreamingLLM: ``sink`` first tokens plus a window of the last ``budget - sink`` tokens."""
    return Policy(**{"budget": budget, "sink": sink, "local": budget - sink, "name": "streaming", **options})


def _quest(**options: Any) -> Policy:
    """Quest: pages of 16 tokens scored by the min/max upper bound, re-selected every step."""
    return _retrieval("quest", "every_step", {"name": "pages", "size": 16}, {"name": "pages", "size": 16}, "bound", options)


def _arkvale(**options: Any) -> Policy:
    """ArkVale: pages of 32 tokens, ranked by their mean-key digest, re-selected every step."""
    return _retrieval("arkvale", "every_step", {"name": "pages", "size": 32}, {"name": "pages", "size": 32}, "top_budget", options)


def _clusterkv(**options: Any) -> Policy:
    """ClusterKV: K-means clusters of ~16 prompt tokens (generated tokens in pages of 16),
    ranked by centroid, re-selected every step."""
    return _retrieval(
        "clusterkv", "every_step", {"name": "kmeans", "tokens_per_cluster": 16}, {"name": "pages", "size": 16},
        "top_budget", options,
    )


# The louiskv preset's trigger for the models kvpolicy ships with: what `kvpolicy calibrate`'s rule
# chose (the cheapest setting within 2 points of every-step selection's top-1 agreement), with the
# trigger that kept the needle score at the lowest re-selection share (EVAL.md, "A trigger that
# knows when reuse is unsafe").
BUILTIN_TRIGGER: dict[str, dict] = {
    # each prompt unit's 4 outlier keys scored by each query head (EVAL.md, "Outlier keys at 8K, on
    # held-out samples and on Gemma 3", session 21), at margin -0.5: on 24 prompts 21.8% re-selecting at
    # 0.3 points under every-step selection's top-1 agreement, on the rule's frontier. (Margin 0 scores the same
    # on 48 needle samples at 18.1% / 21.5% re-selecting at 4K / 8K instead of 22.3% / 25.6%, but the README's
    # demo then answers in other words than full attention: EVAL.md, "The margin on the needles", session 37.)
    # Not the rule's cheapest pick (2.5: 10.1%, 1.9 points under), which loses needle values: 46.1 against 52.3 on 32 4K
    # needle samples, and 68.8 against full's 87.5 on the CI slice, under its bound. Tokens that leave
    # the local window while the selection is kept do not fire (leaving="ignored": firing on them cost
    # 14 points of share on the 4K needles and changed no answer). The query's products with the int8 keys in
    # fixed point (``fixed_query``): 18% off the trigger's GPU kernel (BENCHMARKS.md, session 35), and every one of
    # 56 needle samples tried answered as with exact products (EVAL.md, "The trigger's query in fixed point")
    "smollm2-135m-instruct": {"name": "score_gap", "measure": "mass", "margin": -0.5, "leaving": "ignored",
                              "estimate": "outlier", "outliers": 4, "group": "each", "fixed_query": True},
    # the same outlier trigger, at the rule's own pick on Gemma 3 (EVAL.md, "Gemma 3's default: the outlier
    # trigger at the rule's pick", session 23): on 16 prompts of 2,048 tokens margin 0.5 re-selects 15.7% at
    # 1.2 points under every-step selection's top-1 agreement; on the 16K needles (16 samples) and at 32K (seed 0)
    # it credits the values every-step clusterkv does at 10-15% re-selecting, where the mean-key trigger (-2.5,
    # session 18) lost a needle at 16K
    "gemma-3-270m": {"name": "score_gap", "measure": "mass", "margin": 0.5, "leaving": "ignored",
                     "estimate": "outlier", "outliers": 4, "group": "each", "fixed_query": True},
}


def _stored_trigger(key: str) -> dict | None:
    path = calibration_file()
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    trigger = entry.get("trigger") if isinstance(entry, dict) else None
    return dict(trigger) if isinstance(trigger, dict) and "name" in trigger else None


def louiskv_trigger(model: Any = None) -> dict:
    """The louiskv preset's default trigger for ``model`` (a model or its id): the user's calibrated
    ``score_gap`` setting (``kvpolicy calibrate``), else the built-in one (``BUILTIN_TRIGGER``), else
    the paper's ``query_cosine`` at the model's calibrated tau (0.7 without a model or calibration)."""
    if model is None:
        return {"name": "query_cosine", "tau": DEFAULT_TAU}
    key = model_id(_embedded_id(model))
    found = _stored_trigger(key) or BUILTIN_TRIGGER.get(key)
    if found is not None:
        return dict(found)
    return {"name": "query_cosine", "tau": calibrated_tau(model)}


def _louiskv(model: Any = None, **options: Any) -> Policy:
    """LouisKV: K-means clusters of ~16 prompt tokens (LOUISKV_PROMPT_UNITS; FAST_PROMPT_UNITS is the
    faster prefill), generated tokens in segments cut where the
    trigger fired, group-consistent top_budget selection, reused until the trigger fires. The
    trigger is the model's calibrated one when a model is given: for the embedded SmolLM2 and Gemma 3
    score_gap (re-select when an unselected unit would carry e^margin of the held units' estimated
    attention mass; SmolLM2's counts each prompt unit's outlier keys per query head, BUILTIN_TRIGGER;
    tokens leaving the window while the selection is kept do not fire); else the paper's query_cosine (mean query cosine < tau) at the model's
    calibrated tau, 0.7 (LouisKV's for Qwen3-8B) without one. trigger="query_cosine" names the
    paper's trigger at the model's calibrated tau (0.95 for SmolLM2). The first selection is made
    from the prompt's last query at the end of the prefill (``LOUISKV_FIRST_SELECTION``;
    ``first_selection="first_step"`` makes it at the first decode step, whatever the trigger says)."""
    model = _embedded_id(model)
    trigger = options.pop("trigger", None)
    if trigger is None:
        trigger = louiskv_trigger(model)
    elif trigger == "query_cosine" or (isinstance(trigger, dict) and trigger.get("name") == "query_cosine"
                                       and "tau" not in trigger):
        # the paper's trigger by name: at the model's calibrated tau
        tau = calibrated_tau(model) if model is not None else DEFAULT_TAU
        trigger = {**(trigger if isinstance(trigger, dict) else {"name": "query_cosine"}), "tau": tau}
    options.setdefault("first_selection", LOUISKV_FIRST_SELECTION)
    return _retrieval(
        "louiskv", trigger, dict(LOUISKV_PROMPT_UNITS),
        {"name": "segments", "max_size": 64}, "top_budget", options,
    )


# The louiskv preset selects first at the end of the prefill, from the prompt's last query, and its trigger
# decides from the first decode step on: on SmolLM2's 8K needles (16 samples) the forced first-step selection
# was 9.0 of the 25.6% share; selecting from the prompt instead, 15 of 16 answers are the same, the score too
# (37.5), at 17.6%; on its 32 4K samples 54.7 at 16.6% against 52.3 at 22.3% (EVAL.md, "The first selection
# from the prompt's last query", session 44)
LOUISKV_FIRST_SELECTION = "prompt"


# The louiskv preset's prompt units: K-means of ~16 tokens a cluster, KMeans' own defaults (8 Lloyd
# iterations from evenly spaced tokens, "split" precision, runs of at most 16,384 tokens).
LOUISKV_PROMPT_UNITS = {"name": "kmeans", "tokens_per_cluster": 16}
# A faster prefill: 3 iterations with bf16 distances, ``preset("louiskv", prefill_units=FAST_PROMPT_UNITS)``.
# On the H200 its units are ready within 5% of full attention's TTFT from 8K to 64K, where the
# default's are 10% / 7% / 5% over at 8K / 32K / 64K (BENCHMARKS.md, sessions 17 and 18). Accuracy (EVAL.md, "Fewer K-means iterations for the
# prompt's units"): 40.6 against 39.1 on SmolLM2's 4K needles (16 samples), but 68.8 against 75.0 on
# CI's 2K slice (tests/integration/test_eval_slice.py: 4 cells, one multi-value value), under that
# test's bound, so it is not the default (session 11).
FAST_PROMPT_UNITS = {"name": "kmeans", "tokens_per_cluster": 16, "iters": 3, "init": "spaced", "precision": "bf16"}


# pariskv's collision votes for the models kvpolicy ships with where ParisKV's group-mean votes lose
# what one head attends: each query head votes, a key keeps its best head's votes (EVAL.md, "pariskv's
# per-head votes": Gemma 3 270M's 4K needles 0.0 with the group's mean, 50.0 with each head's, as
# full attention; SmolLM2 75.0 either way, so it keeps ParisKV's cheaper votes)
BUILTIN_PARISKV_VOTES: dict[str, str] = {"gemma-3-270m": "head_max"}


# pariskv's rerank: the GQA group's mean query's 4-bit estimate, as ParisKV ranks. Each query head's logits
# softmaxed over the candidates and summed over the group (collision_rerank's rerank="head_softmax") are
# at least as accurate on every measured cell (EVAL.md, "pariskv's rerank per query head": SmolLM2 8K
# 45.3 against 39.1, 4K 82.8 against 76.6, Gemma 3 8K 46.9 either way), but its Triton passes cost 3.0
# ms a step at 1x32K and 3.4 at 1x128K on an H100 (0.78x full attention at 1x32K against 1.02x;
# BENCHMARKS.md, session 29), in 17 launches a layer. They are two since (the logit queries from
# query_votes, the normalisers in the logits pass), unmeasured (benchmarks/head_softmax_rerank.py):
# the default once they run near group_mean's cost
PARISKV_RERANK = "group_mean"


def pariskv_votes(model: Any = None) -> str:
    """The pariskv preset's collision votes for ``model`` (a model or its id): ``BUILTIN_PARISKV_VOTES``'s
    entry, else ParisKV's ``group_mean``."""
    if model is None:
        return "group_mean"
    return BUILTIN_PARISKV_VOTES.get(model_id(_embedded_id(model)), "group_mean")


def _pariskv(model: Any = None, **options: Any) -> Policy:
    """ParisKV: every token indexed by data-independent sign-pattern centroids of an SRHT-rotated
    key (16 subspaces: 8 dims, 256 centroids each at head_dim 128; 4 dims, 16 centroids at 64)
    and a 4-bit code; every step, tiered collision votes of the GQA group's mean query (6 tiers,
    63 ranked centroids per subspace; 4 tiers, 15 at 4 dims; for Gemma 3 each query head's votes,
    a key keeping its best head's: ``pariskv_votes``) pick candidates by zone length as
    ParisKV's code does (``kvpolicy.analytic.CANDIDATE_BANDS``: 0.5 of the zone below 5K tokens,
    0.25 to 10K, 0.2 to 30K, 0.1 beyond; held so that a longer zone never keeps fewer:
    ``hold_count``), at least twice the retrieval budget, and their 4-bit estimates of q.k pick the
    final ones: the group's mean query's, as ParisKV (``PARISKV_RERANK``; ``rerank="head_softmax"``
    ranks by each query head's, softmaxed over the candidates and summed over the group: more
    accurate, slower); the pipeline's files are listed in ``kvpolicy.analytic``'s docstring. Sink 4,
    local 64 and an update buffer of 64 tokens (a quarter of the retrieval budget if smaller),
    attended in full and indexed 64 at a time; all within the budget. ParisKV's own settings
    (sink 4, local 512, buffer 512, top-k 2048) are budget=3076, local=512 with
    analytic(update_buffer=512)."""
    budget = options.get("budget", DEFAULT_BUDGET)
    sink, local = options.get("sink", DEFAULT_SINK), options.get("local", DEFAULT_LOCAL)
    units = {"name": "analytic", "update_buffer": _update_buffer(budget, sink, local)}
    selector = {"name": "collision_rerank", "votes": pariskv_votes(model), "rerank": PARISKV_RERANK}
    return _retrieval("pariskv", "every_step", units, units, selector, options)


def _update_buffer(budget: Any, sink: Any, local: Any) -> int:
    """The analytic update buffer's default: 64 tokens, or a quarter of the retrieval budget if that is less
    (the buffer is attended inside the budget, so the retrieved top-k keeps at least three quarters)."""
    try:
        room = budget - sink - local
    except TypeError:  # a bad value: Policy names it
        return DEFAULT_UPDATE_BUFFER
    return max(1, min(DEFAULT_UPDATE_BUFFER, room // 4))


def _oracle(**options: Any) -> Policy:
    """Oracle: the exact top-budget tokens by attention mass, every step (an upper bound for
    evaluation; it reads every key each step)."""
    # no forced sink or window: only the current token is kept outside the selection
    options = {"sink": 0, "local": 1, **options}
    return _retrieval("oracle", "every_step", {"name": "pages", "size": 1}, {"name": "pages", "size": 1}, "oracle", options)


def _retrieval(name, trigger, prefill_units, decode_units, selector, options) -> Policy:
    fields = {
        "trigger": trigger,
        "prefill_units": prefill_units,
        "decode_units": decode_units,
        "selector": selector,
        "budget": DEFAULT_BUDGET,
        "sink": DEFAULT_SINK,
        "local": DEFAULT_LOCAL,
        "name": name,
    }
    fields.update(options)
    return Policy(**fields)


PRESETS: dict[str, Callable[..., Policy]] = {
    "full": _full,
    "streaming": _streaming,
    "quest": _quest,
    "arkvale": _arkvale,
    "clusterkv": _clusterkv,
    "louiskv": _louiskv,
    "pariskv": _pariskv,
    "oracle": _oracle,
}


def preset(name: str, *, model: Any = None, **options: Any) -> Policy:
    """The named preset, with any Policy field overridden (``budget=1024``, ``placement="gpu"``...).

    ``model`` (a model or its id) picks per-model defaults (louiskv's trigger, pariskv's votes).
    """
    try:
        factory = PRESETS[name]
    except KeyError:
        raise UnknownNameError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
    if name in ("louiskv", "pariskv"):
        return factory(model=model, **options)
    return factory(**options)


def preset_doc(name: str) -> str:
    return " ".join((PRESETS[name].__doc__ or "").split())
