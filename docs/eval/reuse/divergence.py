"""Where louiskv first leaves every-step clusterkv on one needle sample, and what each layer held there
(a diagnostic for EVAL.md, issue 14's "first selection from the prompt's last queries").

    OMP_NUM_THREADS=1 python docs/eval/reuse/divergence.py TASK LENGTH SEED ['LOUISKV_OPTIONS_JSON'] [W]

Both policies decode greedily; then both are teacher-forced along clusterkv's answer, and at each step
and layer the script records the true attention mass (all heads' softmax over the whole context, at that
step's query) on each needle value's tokens, and the share of it that each policy attends to. At the
first step where louiskv's greedy answer differs from clusterkv's, it prints per layer: louiskv's gap and
whether it fired, the share of the needed needle's mass each policy holds, and the same for an emulated
first selection made from the mean of the prompt's last W post-RoPE queries (default 16; TopBudget's
score is linear in the query, so this is the mean of their scores), and whether louiskv re-selected in
that layer between its first step and the divergence (which would have replaced such a first selection),
and the share of the whole attention mass (all tokens) each policy's attended tokens hold there.
"""
import json
import sys

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvpolicy
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.tasks import build_chat, get_task, make_sample, score
from kvpolicy.models import load_model

task, length, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
window = int(sys.argv[5]) if len(sys.argv) > 5 else 16
torch.manual_seed(0)
model, tok = load_model("smollm2")
sample = make_sample(task, tok, length, seed)
chat = build_chat(tok, sample)
ids = chat["input_ids"][0].tolist()

# the prompt's last W queries per layer, captured in the dense prefill
captured = {}
name = model.config._attn_implementation
inner = ALL_ATTENTION_FUNCTIONS[name]


def capture(module, query, key, value, attention_mask, **kwargs):
    captured[module.layer_idx] = query[:, :, -window:].detach().float().clone()  # (1, Hq, W, D)
    return inner(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("capture_q", capture)
model.config._attn_implementation = "capture_q"
shared = decoding.prefill(model, chat["input_ids"], chat["attention_mask"])
model.config._attn_implementation = name

# needle value spans: token index ranges whose text holds each answer
pieces = [tok.decode([t]) for t in ids]
text, starts = "", []
for p in pieces:
    starts.append(len(text))
    text += p
spans = {}
for answer in sample.answers:
    at = text.find(answer)
    while at >= 0:
        first = max(i for i, s in enumerate(starts) if s <= at)
        last = max(i for i, s in enumerate(starts) if s < at + len(answer))
        spans.setdefault(answer, []).append((first, last + 1))
        at = text.find(answer, at + 1)

steps = get_task(task).max_new_tokens
stop = {tok.eos_token_id}
cluster = kvpolicy.preset("clusterkv", budget=512)
louis = kvpolicy.preset("louiskv", model=model, budget=512, **options)
c_out = decoding.decode(model, shared, cluster, steps, stop_ids=stop)
l_out = decoding.decode(model, shared, louis, steps, stop_ids=stop)
c_text = tok.decode(c_out.tokens, skip_special_tokens=True)
l_text = tok.decode(l_out.tokens, skip_special_tokens=True)
print(f"{task} {length} seed {seed} answers {sample.answers}")
print(f"  needle spans (token index): {spans}")
print(f"  clusterkv: {c_text!r} score {score(task, c_text, sample.answers)}")
print(f"  louiskv:   {l_text!r} score {score(task, l_text, sample.answers)}  share {l_out.reselect_share:.3f}")
diverge = next((i for i, (a, b) in enumerate(zip(c_out.tokens, l_out.tokens)) if a != b), None)
if diverge is None:
    print("  no divergence")
    sys.exit(0)
print(f"  first divergence at step {diverge}: clusterkv {tok.decode([c_out.tokens[diverge]])!r}, "
      f"louiskv {tok.decode([l_out.tokens[diverge]])!r}; clusterkv so far {tok.decode(c_out.tokens[:diverge + 1])!r}")

slot_of_answer = {a: torch.tensor([i for s, e in sp for i in range(s, e)]) for a, sp in spans.items()}


def recorder(record, emulate=False):
    def observe(state, query):
        store = state.store
        probs = decoding.true_attention(store, query)
        h, cap = probs.shape[1], probs.shape[3]
        probs = probs[0]  # (H, G, cap)
        slots, valid = store.attended_slots()
        attended = _mask(slots[0], valid[0], h, cap)
        row = {"fire": int(state.reselect[0])}
        # the share of the whole attention mass the attended tokens hold (mean over query heads)
        row["mass_held"] = float((probs * attended[:, None, :]).sum(-1).mean())
        gap = getattr(state.trigger_state, "gap", None)
        if gap is not None:
            row["gap"] = round(float(gap[0]), 2)
        for a, where in slot_of_answer.items():
            mass = probs[..., where].sum(-1)  # (H, G)
            held = (probs[..., where] * attended[:, None, where]).sum(-1)
            row[a] = (float(mass.mean()), float(held.sum() / mass.sum().clamp(min=1e-12)))
        if emulate and state.decode_steps == 1:  # counted before the observers run
            qm = captured[state.layer_idx].mean(2)  # (1, Hq, D)
            sel = state.policy.selector.select(qm, state.units, store.retrieval_capacity, state.ops)
            em = _mask(sel.slots[0], sel.slot_valid[0], h, cap)
            # and the sink + local window, which any selection keeps
            em |= attended & ~_mask(store.retrieved.slots[0], store.retrieved.valid[0], h, cap)
            record.setdefault("emulated", {})[state.layer_idx] = em
        record.setdefault(state.layer_idx, []).append(row)
    return observe


def _mask(slots, valid, h, cap):
    """``(H, cap)`` bool: the slots listed where valid (slots, valid: ``(H, K)``)."""
    mask = torch.zeros(h, cap, dtype=torch.bool)
    for head in range(h):
        mask[head, slots[head][valid[head]].clamp(max=cap - 1)] = True
    return mask


c_rec, l_rec = {}, {}
forced = c_out.tokens[:diverge + 1]
decoding.decode(model, shared, cluster, len(forced), forced=forced, observers=[recorder(c_rec)])
decoding.decode(model, shared, louis, len(forced), forced=forced, observers=[recorder(l_rec, emulate=True)])

# the needle whose value is being written: the answer with the most attention mass at the divergence
layers = sorted(k for k in c_rec if isinstance(k, int))
# observer entry j is the step whose query writes token j + 1 (token 0 comes from the dense prefill)
at = diverge - 1
print(f"  recorded steps: clusterkv {len(c_rec[layers[0]])}, louiskv {len(l_rec[layers[0]])}; reading entry {at}")
need = max(slot_of_answer, key=lambda a: sum(c_rec[layer][at][a][0] for layer in layers))
print(f"  needle read at the divergence (most attention mass): {need}")
print("  layer | louiskv fired@step (0..div) | gap@div | mass on needle | held: clusterkv louiskv | emulated first sel."
      " | all mass held: clusterkv louiskv")
emulated = l_rec.get("emulated", {})
where = slot_of_answer[need]
for layer in layers:
    fired = "".join(str(r["fire"]) for r in l_rec[layer][:at + 1])
    c_row, l_row = c_rec[layer][at], l_rec[layer][at]
    em = emulated.get(layer)
    em_share = float(em[:, where].float().mean()) if em is not None else float("nan")
    print(f"  {layer:5d} | {fired:>{at + 1}} | {l_row.get('gap', float('nan')):7.2f} | {c_row[need][0]:.3f} | "
          f"{c_row[need][1]:.2f} {l_row[need][1]:.2f} | {em_share:.2f} of its tokens | "
          f"{c_row['mass_held']:.3f} {l_row['mass_held']:.3f}")
