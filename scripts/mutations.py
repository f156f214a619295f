"""The named mutations ``scripts/mutation_check.py`` applies, one at a time, to a copy of the tree.

Each is a deliberate bug in the decode path that the named tests must catch (fail on). ``original``
must occur exactly once in ``file``: when the code it names is rewritten, the check reports the
mutation as STALE and fails, and whoever rewrote the code updates the entry here (the same bug,
written against the new code) rather than deleting it.

``tests`` are pytest arguments (files, node ids, ``-k`` expressions), run with ``-x``; keep them
to the few files that should catch the bug, so the whole check stays minutes, not the suite's time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in ``file``
    replacement: str
    tests: tuple[str, ...]  # pytest arguments
    why: str  # the bug, in a line


MUTATIONS: tuple[Mutation, ...] = (
    # --- the five of issue 11 (each passed the whole relevant suite before these tests) -------
    Mutation(
        name="mean-key-scores-negated",
        file="kvpolicy/kernels/reference.py",
        original="    return summed / (size.clamp(min=1) * query_group.shape[2])",
        replacement="    return -summed / (size.clamp(min=1) * query_group.shape[2])",
        tests=("tests/selectors/test_selectors.py", "tests/test_layer.py"),
        why="top_budget ranks units worst first",
    ),
    Mutation(
        name="query-cosine-max-over-heads",
        file="kvpolicy/kernels/reference_step.py",
        original="similarity = torch.nn.functional.cosine_similarity(q, previous, dim=-1).mean(dim=-1)",
        replacement="similarity = torch.nn.functional.cosine_similarity(q, previous, dim=-1).amax(dim=-1)",
        tests=("tests/test_layer.py", "tests/triggers/test_triggers.py"),
        why="query_cosine decides on the most similar head, not the mean over heads",
    ),
    Mutation(
        name="layer-ignores-the-trigger",
        file="kvpolicy/layer.py",
        original="        store.fetch(selection.slots, selection.slot_valid, reselect, self.ops)",
        replacement="        store.fetch(selection.slots, selection.slot_valid, torch.ones_like(reselect), self.ops)",
        tests=("tests/integration/test_transformers.py", "-k", "small_budget"),
        why="every re-selection fetches for every sequence, whatever the trigger said for each",
    ),
    Mutation(
        name="index-files-the-new-token",
        file="kvpolicy/layer.py",
        original="self.units.append_leaving_token(evicted.slot, evicted.key, evicted.valid, self.boundary,",
        replacement="self.units.append_leaving_token(evicted.slot, key, evicted.valid, self.boundary,",
        tests=("tests/test_layer.py",),
        why="the unit table and the analytic index take this step's key for the slot that left the window",
    ),
    Mutation(
        name="host-read-of-next-slot",
        file="kvpolicy/kernels/reference_step.py",
        original="    slot = store.next_slot\n    evicted, pool, ring, sink =",
        replacement="    slot = torch.tensor(int(store.next_slot), device=store.next_slot.device)\n    evicted, pool, ring, sink =",
        tests=("tests/test_graph_ready.py",),
        why="the step reads its slot on the host: a graph replay would write every token to the captured slot",
    ),
    # --- weak spots found by breaking the code ----------------------------------------------
    Mutation(
        name="bound-mean-over-group",
        file="kvpolicy/kernels/reference.py",
        original="    return bound.amax(dim=2)",
        replacement="    return bound.mean(dim=2)",
        tests=("tests/selectors/test_selectors.py",),
        why="Quest's bound averaged over the GQA group instead of its largest head",
    ),
    Mutation(
        name="bound-min-max-swapped",
        file="kvpolicy/kernels/reference.py",
        original='torch.einsum("bhgd,bhud->bhgu", positive, high) + torch.einsum("bhgd,bhud->bhgu", negative, low)',
        replacement='torch.einsum("bhgd,bhud->bhgu", positive, low) + torch.einsum("bhgd,bhud->bhgu", negative, high)',
        tests=("tests/selectors/test_selectors.py", "tests/test_layer.py"),
        why="the bound takes the smallest q.k in the box, not the largest",
    ),
    Mutation(
        name="oracle-max-over-group",
        file="kvpolicy/selectors/oracle.py",
        original="        return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=2)",
        replacement="        return torch.softmax(logits, dim=-1).nan_to_num(0.0).amax(dim=2)",
        tests=("tests/selectors/test_selectors.py",),
        why="the oracle ranks by the largest head's mass, not the group's total",
    ),
    Mutation(
        name="segments-ignore-boundaries",
        file="kvpolicy/units/segments.py",
        original="        return self.max_size, True",
        replacement="        return self.max_size, False",
        tests=("tests/test_layer.py",),
        why="LouisKV's segments are never cut at a semantic boundary",
    ),
    Mutation(
        name="segment-cut-one-slot-late",
        file="kvpolicy/kernels/reference_step.py",
        original="    fired = boundary.index_select(1, slot.view(1))[:, 0]",
        replacement="    fired = boundary.index_select(1, (slot + 1).view(1))[:, 0]",
        tests=("tests/test_layer.py",),
        why="a segment is cut after the token whose step fired, not at it",
    ),
    Mutation(
        name="cut-rule-one-token-late",
        file="kvpolicy/kernels/reference_step.py",
        original="    cut = (open_size == 0) | (open_size >= max_size)",
        replacement="    cut = (open_size == 0) | (open_size > max_size)",
        tests=("tests/test_layer.py",),
        why="decode pages (and capped segments) hold one token more than their size",
    ),
    Mutation(
        name="unit-min-takes-max",
        file="kvpolicy/kernels/reference.py",
        original="torch.where(keep, torch.minimum(old_min, k), old_min)",
        replacement="torch.where(keep, torch.maximum(old_min, k), old_min)",
        tests=("tests/test_layer.py",),
        why="a decode unit's key_min keeps the largest key",
    ),
    Mutation(
        name="admit-on-reselecting-steps",
        file="kvpolicy/layer.py",
        original="            store.admit(evicted, ~reselect, ops)",
        replacement="            store.admit(evicted, reselect, ops)",
        tests=("tests/integration/test_dense_equivalence.py", "-k", "keep or interval"),
        why="a leaving token is admitted only where the buffer was just re-selected, so reuse steps drop it",
    ),
    Mutation(
        name="fetch-fills-the-whole-buffer",
        file="kvpolicy/kernels/reference_step.py",
        original="torch.where(take[..., 0], slot_valid.sum(-1), buffer.fill)",
        replacement="torch.where(take[..., 0], torch.full_like(buffer.fill, slot_valid.shape[-1]), buffer.fill)",
        tests=("tests/integration/test_dense_equivalence.py", "tests/test_store_refresh.py", "-k", "keep or interval or overlapping"),
        why="a selection marks the buffer full, so nothing is ever admitted",
    ),
    Mutation(
        name="interval-off-by-one",
        file="kvpolicy/kernels/reference_step.py",
        original="    fire = steps % n == 0",
        replacement="    fire = steps % n == 1",
        tests=("tests/integration/test_dense_equivalence.py", "-k", "interval"),
        why="interval(n) fires at steps 1, n + 1, ... (and the forced first)",
    ),
    Mutation(
        name="collision-rerank-no-candidate-floor",
        file="kvpolicy/kernels/reference_analytic.py",
        original="    return torch.ceil(valid_count.float() * share).long().clamp(min=floor)",
        replacement="    return torch.ceil(valid_count.float() * share).long()",
        tests=("tests/selectors/test_selectors.py", "tests/units/test_analytic_index.py"),
        why="ParisKV's candidates are the length rule's share of the tokens even where that is less than twice the budget",
    ),
    Mutation(
        name="collision-votes-ignore-tiers",
        file="kvpolicy/selectors/collision_rerank.py",
        original="        votes_per_rank = _votes_on(tiers, device)",
        replacement="        votes_per_rank = torch.ones_like(_votes_on(tiers, device))",
        tests=("tests/selectors/test_selectors.py", "tests/units/test_analytic_index.py"),
        why="every ranked centroid gets one vote, whatever its tier",
    ),
    Mutation(
        name="kmeans-farthest-centroid",
        file="kvpolicy/kernels/reference.py",
        original="        labels = distance.argmin(dim=-1)",
        replacement="        labels = distance.argmax(dim=-1)",
        tests=("tests/test_layer.py", "-k", "clusterkv or louiskv"),
        why="K-means assigns each key to its farthest centroid",
    ),
    Mutation(
        name="resident-rows-trust-unwritten-slots",
        file="kvpolicy/kernels/reference_step.py",
        original="    held = (slots >= 0) & (slots < store.next_slot)",
        replacement="    held = slots >= 0",
        tests=("tests/test_store_refresh.py",),
        why="a buffer row read before its slot was written is reused after the write",
    ),
    # --- session 5's code: the sink filled from the ring, the threshold select, passed caches -
    Mutation(
        name="sink-never-filled-from-the-ring",
        file="kvpolicy/kernels/reference_step.py",
        original="    sink.valid.logical_or_(to_sink[:, None, :])\n",
        replacement="",
        tests=("tests/test_store.py", "-k", "shorter"),
        why="a prompt shorter than the window never fills its sink (streaming becomes a sliding window)",
    ),
    Mutation(
        name="threshold-select-drops-the-cut-unit",
        file="kvpolicy/kernels/triton/select.py",
        original="            keep = (live & (high == cut)) != 0",
        replacement="            keep = (live & (high > cut) & (high < cut)) != 0",
        tests=("tests/kernels/triton/test_select.py", "-k", "threshold"),
        why="the threshold select leaves out the units tied with the cut (the cut unit among them), so the budget is not filled",
    ),
    Mutation(
        name="a-passed-dense-cache-runs-silently",
        file="kvpolicy/integrations/transformers.py",
        original="        if not isinstance(passed, PolicyCache):",
        replacement="        if False:",
        tests=("tests/integration/test_transformers.py", "-k", "dense_cache"),
        why="a DynamicCache passed to generate inside policy.apply() runs dense without a word",
    ),
    # --- session 7: the H200's replay diverged at budgets past the context -------------------
    Mutation(
        name="reserved-tiers-remade-every-step",
        file="kvpolicy/store.py",
        original="        if any(w > n for w, n in zip(wanted, now)):",
        replacement="        if wanted != now:",
        tests=("tests/test_graph_ready.py", "-k", "past"),
        why="after a reserve the attended buffer is re-made each step, so a captured step writes buffers the next replay no longer reads",
    ),
)
