"""The accepted values of a policy's string fields, apart from the runtime that serves them, so
that ``kvpolicy.policy`` (a pure spec) can check them without importing kernels or stores."""

# kernel backends: "auto" takes the fastest that can serve each op (``kernels.dispatch``)
BACKENDS = ("auto", "reference", "triton")
# where a layer's full KV (its pool) lives; see ``Policy``
PLACEMENTS = ("cpu", "gpu", "split")
# what a full retrieved buffer does with a token leaving the local window while the selection is
# kept: "room" drops it; "evict" keeps it in place of the lowest-ranked selected row
ADMITS = ("room", "evict")
# when a policy that keeps its selection makes its first one: "first_step" at the first decode step,
# whatever the trigger says; "prompt" at the end of the prefill, from the prompt's last query, so the
# trigger decides from the first decode step on
FIRST_SELECTIONS = ("first_step", "prompt")
