"""Policy: a trigger, two unit builders, a selector, a budget and zones, composed in Python.

    from kvpolicy import Policy
    from kvpolicy.triggers import QueryCosine
    from kvpolicy.units import KMeans, Segments
    from kvpolicy.selectors import TopBudget

    policy = Policy(trigger=QueryCosine(tau=0.6), prefill_units=KMeans(16),
                    decode_units=Segments(), selector=TopBudget(), budget=1024)
    with policy.apply(model):
        model.generate(**inputs, max_new_tokens=256)

Components may also be given by registered name or as ``{"name": ..., **options}``.
Everything is resolved and validated when the Policy is built, never mid-decode.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from .choices import ADMITS, BACKENDS, FIRST_SELECTIONS, PLACEMENTS
from .errors import ConfigError
from .registry import base_class, lookup

if TYPE_CHECKING:
    from .selectors.base import Selector
    from .triggers.base import Trigger
    from .units.base import UnitBuilder


def _resolve(kind: str, spec: Any) -> Any:
    """A component instance from an instance, a registered name or ``{"name": ..., **options}``."""
    base = base_class(kind)
    if spec is None or isinstance(spec, base):
        return spec
    if isinstance(spec, str):
        return lookup(kind, spec)()
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError(f"{kind} given as a dict needs a 'name' key, got {dict(spec)!r}")
        cls = lookup(kind, name)
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        unknown = set(options) - known
        if unknown:
            raise ConfigError(
                f"{kind} {name!r} has no option(s) {', '.join(sorted(unknown))}; "
                f"its options: {', '.join(sorted(known)) or '(none)'}"
            )
        return cls(**options)
    raise ConfigError(f"{kind} must be a {base.__name__}, a registered name or a dict, got {spec!r}")


@dataclass
class Policy:
    """What to keep on the attention device and when to change it.

    ``budget``: tokens attended per decode step (sink + retrieved + local), per sequence and
    KV head; ``None`` means dense attention over the whole cache (the ``full`` preset).
    ``sink`` / ``local``: tokens always kept at the start / end. ``placement``: where the full KV
    lives ("cpu": pinned host memory when the model is on a GPU; "gpu": the model's device;
    "split": each layer's pool on the model's device while ``gpu_pool_bytes`` allows, the other
    layers' in pinned host memory, so a batch whose KV exceeds the GPU still decodes).
    ``gpu_pool_bytes``: with "split", the most bytes of KV pool kept on the model's device, over
    all layers of one cache; ``None`` sizes it from the device's free memory as each layer's
    prompt arrives, leaving headroom (``kvpolicy.placement.auto_headroom``).
    ``unit_cache_rows``: the GPU unit cache, rows per sequence and KV head that re-selections
    read from a host pool most recently, kept on the attention device so that a unit coming back
    into the selection is not read across PCIe again. ``None`` sizes it where a layer's pool is
    in host memory (twice the retrieved rows, less where free device memory is short:
    ``kvpolicy.layer.auto_cache_rows``); 0 turns it off; a number keeps that many rows for every
    layer, wherever its pool is, and must be at least ``budget - sink - local``.
    ``backend``: kernel backend, "auto", "reference" or "triton".
    ``admit``: a token leaving the local window while the selection is kept joins the retrieved
    buffer while it has room; at a full buffer, "room" drops it, "evict" keeps it in place of the
    lowest-ranked selected row (so the prompt's last tokens, the question, stay attended without
    a re-selection; at most the selection's own rows are given up).
    ``first_selection``: where a policy that keeps its selection makes its first one: "first_step"
    at the first decode step, whatever the trigger says; "prompt" at the end of the prefill, from
    the prompt's last query, so the trigger decides from the first decode step on (the prefill then
    needs that query: ``PolicyLayerState.prefill``'s ``last_query``). A trigger that re-selects
    every step ignores it.
    """

    trigger: Trigger | str | dict = "every_step"
    prefill_units: UnitBuilder | str | dict | None = None
    decode_units: UnitBuilder | str | dict | None = None
    selector: Selector | str | dict | None = None
    budget: int | None = None
    sink: int = 4
    local: int = 64
    placement: str = "cpu"
    gpu_pool_bytes: int | None = None
    unit_cache_rows: int | None = None
    backend: str = "auto"
    admit: str = "room"
    first_selection: str = "first_step"
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self.trigger = _resolve("trigger", self.trigger)
        self.prefill_units = _resolve("units", self.prefill_units)
        self.decode_units = _resolve("units", self.decode_units)
        self.selector = _resolve("selector", self.selector)
        self.validate()

    @property
    def is_dense(self) -> bool:
        return self.budget is None

    @property
    def retrieval_budget(self) -> int:
        """Tokens fetched from the pool per step: the budget less sink and local."""
        return 0 if self.budget is None else self.budget - self.sink - self.local

    def validate(self) -> None:
        for label, value in (("sink", self.sink), ("local", self.local)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{label} must be an integer >= 0, got {value!r}")
        if self.local < 1:
            raise ConfigError(f"local must be at least 1 (the current token lives there), got {self.local}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}; accepted: {', '.join(PLACEMENTS)}")
        limit = self.gpu_pool_bytes
        if limit is not None:
            if self.placement != "split":
                raise ConfigError(f"gpu_pool_bytes applies only to placement='split', got placement={self.placement!r}; "
                                  "use placement='split' or leave gpu_pool_bytes out")
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ConfigError(f"gpu_pool_bytes must be an integer >= 0 (bytes), or None to size it from free "
                                  f"memory; got {limit!r}")
        rows = self.unit_cache_rows
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
            raise ConfigError(f"unit_cache_rows must be an integer >= 0 (rows per sequence and KV head; 0: no cache), "
                              f"or None to size it where a pool is in host memory; got {rows!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown kernel backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
        if self.admit not in ADMITS:
            raise ConfigError(f"unknown admit {self.admit!r}; accepted: {', '.join(ADMITS)}")
        if self.first_selection not in FIRST_SELECTIONS:
            raise ConfigError(f"unknown first_selection {self.first_selection!r}; accepted: "
                              f"{', '.join(FIRST_SELECTIONS)}")
        if self.budget is None:
            return
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget <= 0:
            raise ConfigError(f"budget must be a positive integer (tokens), got {self.budget!r}")
        if self.selector is None:
            if self.budget != self.sink + self.local:
                raise ConfigError(
                    f"a policy without a selector attends only sink + local, so budget must equal "
                    f"sink + local = {self.sink + self.local}, got {self.budget}"
                )
        elif self.budget <= self.sink + self.local:
            raise ConfigError(
                f"budget {self.budget} leaves nothing to retrieve: it must exceed sink + local = "
                f"{self.sink} + {self.local} = {self.sink + self.local}"
            )
        if self.unit_cache_rows and self.unit_cache_rows < self.retrieval_budget:
            raise ConfigError(
                f"unit_cache_rows={self.unit_cache_rows} is smaller than the retrieved rows it caches, budget - sink - "
                f"local = {self.retrieval_budget}: give at least {self.retrieval_budget}, 0 for no cache, or None"
            )
        if self.selector is not None:
            if self.prefill_units is None or self.decode_units is None:
                raise ConfigError("a policy with a selector needs both prefill_units and decode_units")
            if not self.prefill_units.builds_prompt:
                raise ConfigError(
                    f"units {self.prefill_units.registered_name!r} cannot group the prompt (prefill_units); "
                    f"use one of: {', '.join(_builders('builds_prompt'))}"
                )
            if not self.decode_units.builds_decode:
                raise ConfigError(
                    f"units {self.decode_units.registered_name!r} cannot group generated tokens (decode_units); "
                    f"use one of: {', '.join(_builders('builds_decode'))}"
                )
            self._check_index_types()
        for component in (self.trigger, self.prefill_units, self.decode_units, self.selector):
            if component is not None:
                component.validate()
        if self.selector is not None:
            for component in (self.prefill_units, self.decode_units, self.selector):
                component.validate_in(self)

    def _check_index_types(self) -> None:
        """The prefill builder makes the index; the decode builder and the selector must fit it."""
        prefill, decode, selector = self.prefill_units, self.decode_units, self.selector
        index = prefill.index_type()
        if not issubclass(index, selector.reads):
            fitting = [n for n in _names("selector") if issubclass(index, lookup("selector", n).reads)]
            raise ConfigError(
                f"selector {selector.registered_name!r} reads the index type {selector.reads.__name__}, but "
                f"prefill_units {prefill.registered_name!r} build {index.__name__}; selectors for it: {', '.join(fitting)}"
            )
        if index is _unit_table():
            if decode.index_type() is not index:
                raise ConfigError(
                    f"decode_units {decode.registered_name!r} build their own {decode.index_type().__name__} and "
                    f"cannot extend the unit table of prefill_units {prefill.registered_name!r}; use them as "
                    f"prefill_units too, or decode_units one of: {', '.join(_builders('builds_decode', index))}"
                )
        elif decode != prefill:
            # one index takes the prompt and the generated tokens: one set of options
            raise ConfigError(
                f"prefill_units {_short(prefill)} build one index that also takes the generated tokens, so "
                f"decode_units must be the same builder with the same options; got {_short(decode)}"
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "Policy":
        """Build from plain data; ``{"preset": "louiskv", "budget": 1024}`` starts from a preset.

        >>> Policy.from_dict({"trigger": {"name": "query_cosine", "tau": 0.6},
        ...                   "prefill_units": "kmeans", "decode_units": "segments",
        ...                   "selector": "top_budget", "budget": 1024}).budget
        1024
        """
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(config, Mapping):
            raise ConfigError(
                f"a policy config is a mapping of field names to values, got {type(config).__name__} {config!r}; "
                f"fields: {', '.join(sorted(known | {'preset'}))}"
            )
        config = dict(config)
        preset_name = config.pop("preset", None)
        unknown = set(config) - known
        if unknown:
            raise ConfigError(
                f"unknown policy field(s) {', '.join(sorted(map(repr, unknown)))}; fields: {', '.join(sorted(known | {'preset'}))}"
            )
        if preset_name is not None:
            from .presets import preset

            return preset(preset_name, **config)
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        def component(value: Any) -> Any:
            if value is None:
                return None
            fields = dataclasses.asdict(value)
            # options added later are named only away from their defaults, so that the specs (and the
            # eval's cell keys, which hash them) of components at the old behaviour stay as they were
            for name, default in getattr(value, "SPEC_OMITS_AT_DEFAULT", {}).items():
                if fields.get(name) == default:
                    del fields[name]
            return {"name": value.registered_name, **fields}

        spec = {
            "trigger": component(self.trigger),
            "prefill_units": component(self.prefill_units),
            "decode_units": component(self.decode_units),
            "selector": component(self.selector),
            "budget": self.budget,
            "sink": self.sink,
            "local": self.local,
            "placement": self.placement,
            "backend": self.backend,
            "name": self.name,
        }
        if self.placement == "split":
            # only here: a spec's key set (the eval's cell keys hash it) stays as it was elsewhere
            spec["gpu_pool_bytes"] = self.gpu_pool_bytes
        if self.unit_cache_rows is not None:
            spec["unit_cache_rows"] = self.unit_cache_rows
        if self.admit != "room":
            # likewise: the specs (and eval cells) of policies at the old behaviour stay as they were
            spec["admit"] = self.admit
        if self.first_selection != "first_step":
            spec["first_selection"] = self.first_selection
        return spec

    def apply(self, model: Any):
        """Serve ``model``'s attention with this policy inside a ``with`` block.

        >>> with policy.apply(model) as session:   # doctest: +SKIP
        ...     out = model.generate(**inputs, max_new_tokens=64)
        ...     print(session.stats())

        The model is restored on exit. Raises ``UnsupportedModelError`` for models it cannot serve.
        """
        from .integrations.transformers import PolicySession

        return PolicySession(self, model)

    def placement_text(self) -> str:
        """``placement`` as ``describe`` shows it: "split(gpu_pool=40.0GiB)" or "split(gpu_pool=free)"."""
        if self.placement != "split":
            return self.placement
        if self.gpu_pool_bytes is None:
            return "split(gpu_pool=free)"
        return f"split(gpu_pool={bytes_text(self.gpu_pool_bytes)})"

    def describe(self) -> str:
        if self.is_dense:
            return f"{self.name}: dense attention over the whole cache"
        parts = [f"budget={self.budget}", f"sink={self.sink}", f"local={self.local}",
                 f"placement={self.placement_text()}", f"backend={self.backend}"]
        if self.unit_cache_rows is not None:
            parts.append(f"unit_cache_rows={self.unit_cache_rows}")
        if self.selector is not None:
            parts = [
                f"trigger={_short(self.trigger)}",
                f"prefill_units={_short(self.prefill_units)}",
                f"decode_units={_short(self.decode_units)}",
                f"selector={_short(self.selector)}",
                *parts,
            ]
            if not self.trigger.always_reselects:
                parts.insert(4, f"first_selection={self.first_selection}")
        return f"{self.name}: " + ", ".join(parts)


def bytes_text(n: int) -> str:
    """``n`` bytes for a person: "40.0GiB", "3.5MiB", "512B"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f}{unit}"
    return f"{n}B"


def _short(component: Any) -> str:
    options = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(component).items())
    return f"{component.registered_name}({options})"


def _names(kind: str) -> list[str]:
    from .registry import names

    return names(kind)


def _builders(flag: str, index: type | None = None) -> list[str]:
    return [
        n for n in _names("units")
        if getattr(lookup("units", n), flag) and index in (None, lookup("units", n).index_type())
    ]


def _unit_table() -> type:
    return base_class("units").index_type()  # the base builder's index: the unit table
