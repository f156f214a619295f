"""The every-preset matrix: the lists that the dense-equivalence anchor test
(``integration/test_dense_equivalence.py``), the graph-ready contract (``test_graph_ready.py``) and
the selection property tests (``selectors/test_selection_properties.py``) run over. A preset, a
variant or a component added here is tested by all of them.
"""

from __future__ import annotations

import kvpolicy

# presets with options, where the default would leave a path of the decode step untaken
_FLUSHING = {"name": "analytic", "update_buffer": 16}
VARIANTS = {
    # pariskv's default update buffer (64) is not flushed in 64 steps: flush it 3 times
    "pariskv-flushing": ("pariskv", {"prefill_units": _FLUSHING, "decode_units": _FLUSHING}),
    # triggers that keep their selection, so reuse and admission are on the compared path:
    # query_cosine at the lowest tau selects once (the forced first step) and admits from then on
    "louiskv-keep": ("louiskv", {"trigger": {"name": "query_cosine", "tau": -1.0}, "first_selection": "first_step"}),
    "quest-interval": ("quest", {"trigger": {"name": "interval", "n": 8}}),
    # the louiskv preset's first selection is the prompt's: here the first step's instead, and the
    # prompt's with a trigger that then never re-selects
    "louiskv-first-step": ("louiskv", {"first_selection": "first_step"}),
    "louiskv-keep-prompt": ("louiskv", {"trigger": {"name": "query_cosine", "tau": -1.0}}),
    # a GPU unit cache (given a size, it applies on the CPU too): the fetch reads through it.
    # 1024 rows: at least the retrieved rows of the dense-equivalence budget (512 - 68)
    "louiskv-unit-cache": ("louiskv", {"trigger": {"name": "interval", "n": 4}, "unit_cache_rows": 1024}),
}
# every preset, then the variants (dense equivalence)
EVERY_PRESET = list(kvpolicy.PRESETS) + list(VARIANTS)
# the presets that serve a decode step of their own (graph-ready contract): all but dense attention
RETRIEVAL_PRESETS = ["louiskv", "quest", "arkvale", "clusterkv", "streaming", "oracle", "pariskv"]
# the same with a GPU unit cache (graph-ready contract: ``NAME+cache``)
CACHED_PRESETS = ["louiskv+cache", "pariskv+cache"]

# the components of the selection property tests
PROPERTY_SELECTORS = ["top_budget", "bound"]
PROPERTY_PROMPT_UNITS = ["pages", "kmeans"]
PROPERTY_DECODE_UNITS = ["pages", "segments"]
