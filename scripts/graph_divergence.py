"""Diagnostic (session 7): where a replayed decode departs from eager decode, and by how much.

For each case: eager generate's tokens and logits, the graph's tokens (node, inline, and the
emulated replay on the same device), then the graph fed eager's tokens, step by step: the largest
logit difference per step against eager's top-2 gap.
"""
import sys

import torch

sys.path.insert(0, "tests")
import kvpolicy  # noqa: E402
from conftest import build_model, left_padded_batch  # noqa: E402
from kvpolicy.graph import DecodeGraph, greedy_decode  # noqa: E402
from kvpolicy.integrations.transformers import cache_argument_name  # noqa: E402

STEPS = 24
CASES = [("qwen3", "louiskv", {"name": "interval", "n": 3}, 512), ("qwen3", "clusterkv", {"name": "interval", "n": 2}, 512),
         ("llama", "clusterkv", None, 512), ("qwen3", "louiskv", {"name": "interval", "n": 3}, 96)]


@torch.inference_mode()
def fed(model, policy, ids, mask, tokens, emulate, branches):
    with policy.apply(model) as session:
        cache = session.new_cache()
        position_ids = mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(mask == 0, 1)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                    **{cache_argument_name(model): cache})
        logits = [out.logits[:, -1].clone()]
        runner = DecodeGraph(model, cache, mask.long().sum(-1), STEPS - 1, emulate=emulate, branches=branches)
        for i in range(STEPS - 1):
            logits.append(runner.step(tokens[:, i]).clone())
        sizes = [(s.store.sink.keys.shape[2], s.store.retrieval_capacity, s.store.local_capacity) for s in runner.states[:1]]
    return torch.stack(logits, 1), sizes


def main():
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    for family, name, trigger, budget in CASES:
        model = build_model(family).to(device)
        ids, mask = left_padded_batch(200)
        ids, mask = ids.to(device), mask.to(device)
        options = {"budget": budget, "sink": 4, "local": 16}
        if trigger:
            options["trigger"] = trigger
        policy = kvpolicy.preset(name, **options)
        with policy.apply(model):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        want = out.sequences[:, ids.shape[1]:]
        eager_logits = torch.stack(out.logits, 1).float()
        top2 = eager_logits.topk(2, -1).values
        gap = top2[..., 0] - top2[..., 1]
        print(f"== {family} {name} trigger={trigger} budget={budget}", flush=True)
        kinds = [("emulated", True, "inline")] + ([("node", False, "node"), ("inline", False, "inline")] if device.type == "cuda" else [])
        for label, emulate, branches in kinds:
            got = greedy_decode(model, policy, ids, mask, STEPS, emulate=emulate, branches=branches)
            differ = (got != want).any(0).nonzero().flatten().tolist()
            logits, sizes = fed(model, policy, ids, mask, want, emulate, branches)
            diff = (logits.float() - eager_logits).abs().amax(-1)  # (B, steps)
            print(f"  {label}: tokens equal={torch.equal(got, want)} first differing step={differ[:1]} tiers(layer0)={sizes}")
            for b in range(diff.shape[0]):
                print(f"    row {b} max|dlogit| per step: " + " ".join(f"{v:.1e}" for v in diff[b].tolist()))
                print(f"    row {b} eager top-2 gap:      " + " ".join(f"{v:.1e}" for v in gap[b].tolist()))


if __name__ == "__main__":
    main()
