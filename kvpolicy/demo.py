"""A needle-in-a-haystack prompt generated locally: the demo's and the accuracy tests' long context.
It is the needle family's passkey prompt (``kvpolicy.eval.tasks.needles``), named here for the demo.

The haystack is short, varied sentences drawn from a seeded RNG (no dataset, no download); the
needle is a five-digit passkey placed at a chosen depth; the question is asked both before and
after the document, inside the tokenizer's chat template. With full attention the embedded
SmolLM2-135M-Instruct (float32, greedy) answers it at 2K and 4K tokens for every seed and depth
tried, so a policy that loses the answer there has dropped KV that mattered. At 8K (the model's
whole context) it misses early needles (depth 0.1: 5 of 8 seeds right; 0.5 and 0.9: 8 of 8), so
keep pass/fail checks at 4K or below.

Example::

    from kvpolicy.models import load_model
    from kvpolicy.demo import needle_prompt, answer_is_correct

    model, tok = load_model()
    demo = needle_prompt(tok, target_tokens=4096, seed=0, depth=0.5)
    out = model.generate(demo.input_ids, attention_mask=demo.attention_mask,
                         max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, demo.num_tokens:], skip_special_tokens=True)
    assert answer_is_correct(text, demo)
"""

from kvpolicy.eval.tasks.needles import DemoPrompt, answer_is_correct, needle_prompt

__all__ = ["DemoPrompt", "answer_is_correct", "needle_prompt"]
