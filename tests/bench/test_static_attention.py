"""The e2e baseline's full attention (StaticCache read by the split-K decode op) equals SDPA."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache

from kvpolicy.bench.static_attention import set_attention, use_static_full_attention
from kvpolicy.integrations.transformers import cache_argument_name


def _decode_logits(model, prompt, steps):
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 3)
    arg = cache_argument_name(model)
    out = model(input_ids=prompt, use_cache=True, **{arg: cache})
    logits, token = [], out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps):
        position = torch.tensor([prompt.shape[1] + i], device=prompt.device)
        out = model(input_ids=token, cache_position=position, use_cache=True, **{arg: cache})
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_full_attention_matches_sdpa(backend):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on CPU, Triton runs interpreted
    model = Qwen3ForCausalLM(config).eval().to(device)
    set_attention(model, "sdpa")
    prompt = torch.randint(0, 97, (2, 37)).to(device)
    with torch.no_grad():
        expected = _decode_logits(model, prompt, 5)
        use_static_full_attention(model, backend)
        got = _decode_logits(model, prompt, 5)
    set_attention(model, "sdpa")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert expected.abs().max() > 1e-3  # logits are not trivially zero
