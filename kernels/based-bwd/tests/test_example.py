"""The Based language model example (examples/train_and_generate.py) at tiny sizes: it trains on packed
variable-length sequences through the kernelized `BasedVarlenAttention` layer, and its generation with a carried
state (prefill with output_final_state, then based_decode a token at a time) chooses every token from the logits
that one forward call over the prompt and the generated text gives at that position."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from testkit import HAS_CUDA, load, rel_err

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_and_generate.py"
TINY = dict(vocab=32, d_model=32, heads=1, feature_dim=8, head_dim=16, layers=2)


@pytest.fixture(scope="module")
def example():
    load("based-bwd")  # the built kernel in the local Hub cache, as the example loads it
    spec = importlib.util.spec_from_file_location("train_and_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_example_trains_packed_and_generates_with_a_carried_state(example, device):
    table = example.bigram_table(TINY["vocab"], 4, seed=0)
    model, based = example.build(device, **TINY)
    assert all(b.mixer.forward.__func__.__qualname__ == "BasedVarlenAttention.forward" for b in model.blocks)
    losses = example.train(model, table, device, steps=12, seqs=3, min_len=4, max_len=40, lr=1e-2)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([5]), torch.tensor([7, 8, 9, 10, 11, 12, 13])]
    new = 9
    tokens, step_logits = example.generate(model, based, prompts, new)
    assert tokens.shape == (3, new) and step_logits.shape == (3, new, TINY["vocab"])
    # one forward call over each prompt and its continuation (packed, no state): the logits at the positions
    # that chose the generated tokens
    full = [torch.cat([p, t[:-1].cpu()]) for p, t in zip(prompts, tokens)]
    cu = torch.tensor([0] + [len(f) for f in full]).cumsum(0).to(device, torch.int32)
    with torch.no_grad():
        logits = model(torch.cat(full)[None].to(device), cu)[0]
    for n, p in enumerate(prompts):
        start = int(cu[n]) + len(p) - 1
        assert rel_err(step_logits[n], logits[start : start + new]) < 1e-5, n
    assert torch.equal(tokens, step_logits.argmax(-1))
