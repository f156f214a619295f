"""transformers integration: a Cache subclass with typed per-layer policy state and an
attention function registered through transformers' ``AttentionInterface``.

Nothing is patched at import. ``policy.apply(model)`` returns a :class:`PolicySession`;
inside its ``with`` block the model's attention implementation is "kvpolicy" and
``model.generate`` gets a :class:`PolicyCache` unless one is passed; on exit both are
restored. Layers the policy does not serve (sliding-window layers of hybrid models) keep
transformers' own cache layers and SDPA attention.

Works with transformers 5.17 (``past_key_values.update(k, v, idx, cache_kwargs)``) through
5.24 (``cache.update(k, v, idx, kwargs=...)``): both reach ``Cache.update``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..errors import KVPolicyError, UnsupportedModelError
from ..kernels import dispatch
from ..layer import PolicyLayerState
from ..placement import PoolPlacer, check_limit

ATTENTION_NAME = "kvpolicy"
# SDPA that keeps each layer's last query: a shared dense prefill's (``record_last_queries``)
LAST_QUERY_ATTENTION = "kvpolicy_last_query"

# The cache whose ``update`` ran last on this thread; the attention function that follows
# in the same layer finds its layer state here (transformers passes it no cache).
_active = threading.local()


def _register() -> None:
    """Make "kvpolicy" a known attention implementation (idempotent, done on first apply)."""
    AttentionInterface.register(ATTENTION_NAME, kvpolicy_attention)
    # prefill runs SDPA, so it wants SDPA's mask
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class PolicyCacheLayer(DynamicLayer):
    """A full-attention layer served by the policy. Holds a :class:`PolicyLayerState`."""

    is_sliding = False
    is_croppable = False

    def __init__(self, state: PolicyLayerState):
        super().__init__()
        self.state = state
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.state.store is not None and key_states.shape[2] != 1:
            raise KVPolicyError(
                f"layer {self.state.layer_idx}: a forward of {key_states.shape[2]} tokens after prefill is not "
                "supported (chunked prefill, assisted or speculative decoding); decode one token per step"
            )
        # the attention function consumes these; they are the prompt's KV or this step's token
        self.pending = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.state.seq_length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVPolicyError("a PolicyCache cannot be reset; make a new one with session.new_cache()")

    def _unsupported(self, *args, **kwargs):
        raise KVPolicyError("PolicyCache does not support beam search, cropping or batch reordering")

    crop = batch_repeat_interleave = batch_select_indices = reorder_cache = _unsupported


class PolicyCache(DynamicCache):
    """transformers' DynamicCache with the policy serving every full-attention layer.

    ``pool_device``: where every layer's pool goes; under placement "split" it is ignored and a
    :class:`~kvpolicy.placement.PoolPlacer` (``placer``, made here unless given) places each."""

    def __init__(self, policy, config, pool_device: torch.device | None, placer: PoolPlacer | None = None):
        super().__init__(config=config)
        if not self.layers:
            raise UnsupportedModelError(
                f"{type(config).__name__}: transformers builds no per-layer cache structure for this model, "
                "so kvpolicy cannot tell its full-attention layers apart"
            )
        self.policy = policy
        self.served: list[int] = []
        self.placer = None
        if policy.placement == "split":
            self.placer = placer or PoolPlacer(pool_device, policy.gpu_pool_bytes)
        for idx, layer in enumerate(self.layers):
            # exact type: sliding-window, linear-attention and other special layers keep their own cache
            if type(layer) is DynamicLayer:
                self.layers[idx] = PolicyCacheLayer(PolicyLayerState(policy, idx, pool_device, self.placer))
                self.served.append(idx)
        if not self.served:
            raise UnsupportedModelError(
                f"{type(config).__name__} has no full-attention layers (all {len(self.layers)} are "
                f"{sorted({type(l).__name__ for l in self.layers})}); kvpolicy serves full-attention layers only"
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _active.cache = self
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def policy_layers(self) -> list[PolicyLayerState]:
        return [self.layers[i].state for i in self.served]


def _token_valid(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """``(batch, length)`` True for real (non-padding) prompt tokens, read off the 4D mask's last row."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    last_row = attention_mask[:, 0, -1, -length:]
    if last_row.dtype != torch.bool:
        last_row = last_row > torch.finfo(last_row.dtype).min / 2
    return last_row.expand(batch, length).to(device)


def kvpolicy_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function: dense prefill, policy decode."""
    cache = getattr(_active, "cache", None)
    layer = None
    if cache is not None:
        candidate = cache.layers[module.layer_idx] if module.layer_idx < len(cache.layers) else None
        if isinstance(candidate, PolicyCacheLayer) and candidate.pending is not None and candidate.pending[0] is key:
            layer = candidate
    if layer is None:  # a layer the policy does not serve, or a forward without our cache
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer.pending = None
    state = layer.state
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if state.store is None:
        out, weights = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        valid = _token_valid(attention_mask, key.shape[0], key.shape[2], key.device)
        state.prefill(key, value, valid, num_q_heads=query.shape[1], last_query=query[:, :, -1])
        return out, weights
    out = state.decode(query[:, :, 0], key[:, :, 0], value[:, :, 0], scale)
    return out.unsqueeze(1), None  # (B, 1, Hq, D), as transformers' attention functions return


def _set_attention(model, name: str) -> None:
    # set on every sub-config so that composite models route their decoder through us
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def _last_query_recorder(module, query, key, value, attention_mask, **kwargs):
    """SDPA that also keeps each layer's last query (``record_last_queries``)."""
    _active.last_queries[module.layer_idx] = query[:, :, -1].clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def record_last_queries(model):
    """Inside the block the model attends with SDPA and the yielded dict fills with each layer's
    last post-RoPE query, ``{layer_idx: (B, Hq, D)}``: what a policy with
    ``first_selection="prompt"`` selects from when its prefill is a shared dense one."""
    AttentionInterface.register(LAST_QUERY_ATTENTION, _last_query_recorder)
    AttentionMaskInterface.register(LAST_QUERY_ATTENTION, sdpa_mask)
    saved = model.config._attn_implementation
    queries: dict[int, torch.Tensor] = {}
    _active.last_queries = queries
    _set_attention(model, LAST_QUERY_ATTENTION)
    try:
        yield queries
    finally:
        _set_attention(model, saved)
        _active.last_queries = None


def cache_argument_name(model) -> str:
    """The keyword a model's forward takes its cache by: "cache" from transformers 5.24, else "past_key_values"."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def last_logits_only(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's forward takes it, else nothing: a prefill that
    needs only the next token's logits then skips the vocabulary projection of every other prompt
    position (Gemma 3's 262,144-word vocabulary in float32 is 1 MB a position: 17 GB at 16K)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _miss_fractions(states) -> dict[str, float | None]:
    """``miss_fraction`` and ``miss_fraction_warm`` of ``RunStats`` over the served layers (host
    reads, after the generation), from the store's exact counters and each layer's counters after
    its first selection (``PolicyLayerState.first_fetch``)."""
    fetched = read = fetched_warm = read_warm = 0
    for s in states:
        fetched += int(s.store.rows_fetched.sum())
        read += int(s.store.pool_rows_read.sum())
        if s.first_fetch is not None:
            fetched_warm += int((s.store.rows_fetched - s.first_fetch[1]).sum())
            read_warm += int((s.store.pool_rows_read - s.first_fetch[0]).sum())
    return {"miss_fraction": read / fetched if fetched else None,
            "miss_fraction_warm": read_warm / fetched_warm if fetched_warm else None}


@dataclass
class RunStats:
    """What one generation did, summed over the served layers."""

    context_tokens: int
    decode_steps: int
    budget: int | None
    # of (layer, sequence, decode step) triples that re-selected; a first selection made at the
    # prefill (``first_selection="prompt"``) is no step's and not counted
    reselect_share: float | None
    device_kv_bytes: int
    full_kv_bytes: int
    served_layers: int
    # the retrieval index's tensors (unit table or analytic index) on the attention device, as
    # allocated: it grows with the generated tokens, beside the budget's fixed buffers
    index_bytes: int = 0
    # the pools (every token's KV) as allocated, on the attention device and in host memory, and
    # the served layers whose pool is on the device (placement "split" chooses them per layer)
    pool_device_bytes: int = 0
    pool_host_bytes: int = 0
    pool_device_layers: list[int] | None = None
    # of the buffer rows the re-selections fetched (``TieredStore.rows_fetched``), the share read
    # from the pool: neither the retrieved buffer nor the GPU unit cache held them
    # (``pool_rows_read``); ``warm``: the same without each layer's first selection, which finds
    # the buffer empty and reads every row (None: no such selection)
    miss_fraction: float | None = None
    miss_fraction_warm: float | None = None
    unit_cache_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class PolicySession:
    """The scope of ``policy.apply(model)``. See :meth:`kvpolicy.Policy.apply`."""

    def __init__(self, policy, model):
        self.policy = policy
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.cache: PolicyCache | DynamicCache | None = None
        self._saved_attn: str | None = None
        self._check_model()
        if not policy.is_dense:
            dispatch.check(policy.backend, self.device)
            if policy.placement == "gpu" and self.device.type != "cuda":
                raise KVPolicyError(
                    f"placement='gpu' keeps the full KV in GPU memory, but the model is on {self.device.type}; "
                    "use placement='cpu' or move the model to a CUDA device"
                )
            if policy.placement == "split":
                # a limit the device cannot hold fails here, never mid-decode
                check_limit(policy.gpu_pool_bytes, self.device)

    def _check_model(self) -> None:
        config = self.config.get_text_config(decoder=True) if hasattr(self.config, "get_text_config") else self.config
        if getattr(self.config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} is an encoder-decoder model; kvpolicy serves decoder-only models"
            )
        if not getattr(self.model, "_supports_attention_backend", False):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} does not route attention through transformers' AttentionInterface, "
                "so kvpolicy cannot serve it"
            )
        for attr in ("num_attention_heads", "num_hidden_layers"):
            if not hasattr(config, attr):
                raise UnsupportedModelError(f"{type(config).__name__} has no {attr}; not a decoder kvpolicy can serve")
        if self.policy.is_dense:
            return  # the model's own attention runs
        # prefill and unserved layers run SDPA, decode runs plain softmax attention: a model whose
        # attention is something else would fail mid-generate or, worse, decode silently wrong
        if not getattr(self.model, "_supports_sdpa", True):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} does not support SDPA attention, which kvpolicy's prefill runs"
            )
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(
                f"{type(config).__name__} caps attention logits (attn_logit_softcapping="
                f"{config.attn_logit_softcapping}); kvpolicy's attention does not"
            )

    @property
    def pool_device(self) -> torch.device:
        """The pools' device ("split": the device side; each layer's is its placer's choice)."""
        if self.policy.placement == "cpu":
            return torch.device("cpu")
        return self.device

    def new_cache(self) -> PolicyCache | DynamicCache:
        """A fresh cache for one generation (``model(..., past_key_values=session.new_cache())``)."""
        self._prompt_length = None  # known only when the session's generate made the cache
        if self.policy.is_dense:
            self.cache = DynamicCache(config=self.config)
        else:
            self.cache = PolicyCache(self.policy, self.config, self.pool_device)
        return self.cache

    def __enter__(self) -> "PolicySession":
        if getattr(self, "_active", False):
            # the inner exit would restore the outer entry's attention, and the outer exit nothing
            raise KVPolicyError("this session is already active (entered twice); use a new policy.apply(model) "
                                "for a nested block, or leave the first one")
        if not self.policy.is_dense:
            # fail now, not mid-generate, if the model has nothing to serve
            PolicyCache(self.policy, self.config, self.pool_device)
            _register()
            self._saved_attn = self.config._attn_implementation
            self._set_attn(ATTENTION_NAME)
        original_generate = self.model.generate
        session = self

        cache_arg = cache_argument_name(self.model)

        def generate(*args, **kwargs):
            session._check_generate_arguments(kwargs)
            passed = kwargs.get("past_key_values", kwargs.get("cache"))
            if passed is None:
                kwargs[cache_arg] = session.new_cache()
            else:
                session.cache = passed
            inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
            session._prompt_length = inputs.shape[-1] if isinstance(inputs, torch.Tensor) else None
            return original_generate(*args, **kwargs)

        self._saved_generate = self.model.__dict__.get("generate")  # an outer session's wrapper
        self.model.generate = generate  # instance attribute, removed on exit
        self._active = True  # set last: an entry that failed is not active
        return self

    def _check_generate_arguments(self, kwargs: dict) -> None:
        """Refuse, in words, what would make ``generate`` bypass the policy or fail mid-decode."""
        if self.policy.is_dense:
            return
        if kwargs.get("use_cache") is False:
            raise KVPolicyError(
                "generate(use_cache=False) recomputes the whole sequence at every step, so the policy has "
                "nothing to serve; drop use_cache=False inside policy.apply() (the policy is the cache)"
            )
        passed = kwargs.get("past_key_values", kwargs.get("cache"))
        if passed is None:
            return
        if not isinstance(passed, PolicyCache):
            raise KVPolicyError(
                f"generate() got a {type(passed).__name__} inside policy.apply(): that cache would run dense "
                "attention and the policy would not run; pass no cache (the session makes one) or "
                "session.new_cache()"
            )
        if any(state.store is not None for state in passed.policy_layers()):
            raise KVPolicyError(
                "this PolicyCache already holds a generation: a second turn on the same cache (a chat) is not "
                "supported, since the policy's index covers one prompt; pass the whole conversation as the "
                "prompt with no cache (the session makes a fresh one)"
            )

    def __exit__(self, *exc) -> None:
        self._active = False
        self.model.__dict__.pop("generate", None)
        if getattr(self, "_saved_generate", None) is not None:
            self.model.generate = self._saved_generate
        self._saved_generate = None
        # the thread-local would otherwise keep this session's full KV pool alive
        if getattr(_active, "cache", None) is self.cache:
            _active.cache = None
        if self._saved_attn is not None:
            self._set_attn(self._saved_attn)
            self._saved_attn = None

    def _set_attn(self, name: str) -> None:
        _set_attention(self.model, name)

    def stats(self) -> RunStats:
        """Figures of the last generation in this session."""
        cache = self.cache
        if cache is None:
            raise KVPolicyError("no generation has run in this session yet")
        if isinstance(cache, PolicyCache):
            states = cache.policy_layers()
            steps = states[0].decode_steps
            batch = states[0].reselections.shape[0]
            total = sum(int(s.reselections.sum()) for s in states)
            has_selector = self.policy.selector is not None
            share = total / (len(states) * steps * batch) if steps and has_selector else None
            misses = _miss_fractions(states) if steps and has_selector else {}
            # layers the policy does not serve (sliding windows) hold their own KV on the device:
            # counted on both sides, so the figures compare like with like
            own = sum(2 * l.keys.numel() * l.keys.element_size() for l in cache.layers
                      if not isinstance(l, PolicyCacheLayer) and getattr(l, "keys", None) is not None)
            device_bytes = sum(s.store.device_bytes() for s in states) + own
            full_bytes = sum(s.store.full_bytes() for s in states) + own
            index = sum(s.index_bytes() for s in states)
            context = states[0].store.length - steps
            served = len(states)
            pool = {"pool_device_bytes": 0, "pool_host_bytes": 0, "pool_device_layers": []}
            pool["unit_cache_bytes"] = sum(s.store.cache.nbytes() for s in states if s.store.cache is not None)
            for s in states:
                on_device = s.plan.pool_on_device
                nbytes = s.store.pool.nbytes()
                pool["pool_device_bytes" if on_device else "pool_host_bytes"] += nbytes
                if on_device:
                    pool["pool_device_layers"].append(s.layer_idx)
        else:
            layers = [l for l in cache.layers if l.keys is not None and l.keys.numel()]
            full_bytes = sum(2 * l.keys.numel() * l.keys.element_size() for l in layers)
            device_bytes = full_bytes
            length = cache.get_seq_length()
            context = getattr(self, "_prompt_length", None) or length
            steps = length - context  # the last generated token is never fed back
            share, served, index = None, len(layers), 0
            pool = {"pool_device_bytes": full_bytes}
            misses = {}
        return RunStats(
            context_tokens=context,
            decode_steps=steps,
            budget=self.policy.budget,
            reselect_share=share,
            device_kv_bytes=device_bytes,
            full_kv_bytes=full_bytes,
            served_layers=served,
            index_bytes=index,
            **pool,
            **misses,
        )
