"""Train a small Based language model on packed variable-length sequences, then generate with a carried state
(random init, no download).

    python train_and_generate.py --device cpu        # the eager reference: about half a minute on two cores
    python train_and_generate.py --device cuda

The model's token mixer is a host module decorated with `use_kernel_forward_from_hub("BasedVarlenAttention")`;
`kernelize(..., mode=Mode.TRAINING)` replaces its forward by based-bwd's `BasedVarlenAttention` layer on either
device. Each training batch packs sequences of random lengths into one row with `cu_seqlens` (no padding, and no
attention across two sequences). Generation prefills the prompts, packed the same way, through the same layer with
`output_final_state=True` (one state (S, z) per sequence and block), then extends all of them together one token a
step with `based_decode`, which carries the state. The data is a fixed random bigram language (each token has a few
likely successors), made on the CPU from the seed, so the loss falls from log(vocab) toward the language's entropy
and the generated text follows the table.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

REPO = "tessera/based-bwd"


def packed_quadratic_form(q, k, v, scale, cu_seqlens):
    """The host mixer's own forward (before kernelize replaces it): Based attention from the full causal weight
    matrix A = 1 + s + s^2 / 2 of each packed sequence, in fp32."""
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[:, a:b].float().transpose(1, 2) for x in (q, k, v))
        s = (scale * qs) @ ks.transpose(-1, -2)
        A = torch.tril(1 + s + 0.5 * s * s)
        out.append(((A @ vs) / (A.sum(-1, keepdim=True) + 1e-6)).transpose(1, 2))
    return torch.cat(out, 1).to(q.dtype)


def make_mixer_class():
    """The host token mixer, decorated for kernelize (made in a function so that importing this file needs no
    `kernels`)."""
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("BasedVarlenAttention")
    class BasedMixer(nn.Module):
        def __init__(self, scale=None):
            super().__init__()
            self.scale = scale

        def forward(self, q, k, v, *, initial_state=None, output_final_state=False, cu_seqlens=None):
            if initial_state is not None or output_final_state:
                raise NotImplementedError("the host mixer keeps no state; kernelize it with based-bwd")
            scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
            return packed_quadratic_form(q, k, v, scale, cu_seqlens)

    return BasedMixer


class BasedBlock(nn.Module):
    """Pre-norm block: Based attention over projected q, k (feature size K) and v (head size V), then an MLP."""

    def __init__(self, mixer_cls, d_model: int, heads: int, feature_dim: int, head_dim: int):
        super().__init__()
        self.heads, self.feature_dim, self.head_dim = heads, feature_dim, head_dim
        self.norm1 = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, heads * (2 * feature_dim + head_dim), bias=False)
        self.mixer = mixer_cls()
        self.out = nn.Linear(heads * head_dim, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def _qkv(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, self.heads, -1).split(
            [self.feature_dim, self.feature_dim, self.head_dim], -1)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _finish(self, x, o):
        x = x + self.out(o.reshape(*x.shape[:2], -1).to(x.dtype))
        return x + self.mlp(self.norm2(x))

    def forward(self, x, cu_seqlens=None, output_final_state=False):
        """x (1, T, d) of packed sequences -> x, and with output_final_state each sequence's state (S, z)."""
        o = self.mixer(*self._qkv(x), output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        if output_final_state:
            o, state = o
            return self._finish(x, o), state
        return self._finish(x, o)

    def step(self, x, state, decode):
        """x (B, T, d): the next T tokens of B sequences from their state -> x and the new state."""
        o, state = decode(*self._qkv(x), state, self.mixer.scale)
        return self._finish(x, o), state


class TinyBasedLM(nn.Module):
    def __init__(self, mixer_cls, vocab: int, d_model: int, heads: int, feature_dim: int, head_dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(BasedBlock(mixer_cls, d_model, heads, feature_dim, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens, cu_seqlens=None, output_final_state=False):
        """Logits of packed tokens (1, T); with output_final_state also the list of the blocks' states."""
        x, states = self.embed(tokens), []
        for block in self.blocks:
            x = block(x, cu_seqlens, output_final_state)
            if output_final_state:
                x, state = x
                states.append(state)
        logits = self.head(self.norm(x))
        return (logits, states) if output_final_state else logits

    def step(self, tokens, states, decode):
        """Logits of the next tokens (B, T) of B sequences, and the blocks' new states."""
        x, new_states = self.embed(tokens), []
        for block, state in zip(self.blocks, states):
            x, state = block.step(x, state, decode)
            new_states.append(state)
        return self.head(self.norm(x)), new_states


def bigram_table(vocab: int, successors: int, seed: int):
    return torch.randint(0, vocab, (vocab, successors), generator=torch.Generator().manual_seed(seed))


def bigram_text(table, count: int, length: int, gen):
    """`count` sequences of `length` tokens of the bigram language (CPU)."""
    tokens = torch.empty(count, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, table.shape[0], (count,), generator=gen)
    for t in range(1, length):
        pick = torch.randint(0, table.shape[1], (count,), generator=gen)
        tokens[:, t] = table[tokens[:, t - 1], pick]
    return tokens


def packed_batches(table, steps: int, seqs: int, min_len: int, max_len: int, seed: int):
    """`steps` batches of `seqs` sequences of random lengths in [min_len, max_len], packed: inputs and targets
    (1, T) and the offsets cu_seqlens (seqs + 1,) int32."""
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        lengths = torch.randint(min_len, max_len + 1, (seqs,), generator=gen)
        text = bigram_text(table, seqs, max_len + 1, gen)
        inputs = torch.cat([row[:n] for row, n in zip(text, lengths.tolist())])
        targets = torch.cat([row[1 : n + 1] for row, n in zip(text, lengths.tolist())])
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        yield inputs[None], targets[None], cu_seqlens


def build(device: str, vocab: int = 64, d_model: int = 64, heads: int = 2, feature_dim: int = 8,
          head_dim: int = 32, layers: int = 2, seed: int = 0):
    """The model (the same init on every device), kernelized in TRAINING mode, and the loaded kernel."""
    from kernels import LayerRepository, Mode, get_kernel, kernelize, use_kernel_mapping

    torch.manual_seed(seed)
    model = TinyBasedLM(make_mixer_class(), vocab, d_model, heads, feature_dim, head_dim, layers).to(device)
    repo = LayerRepository(REPO, layer_name="BasedVarlenAttention", version=1, trust_remote_code=True)
    with use_kernel_mapping({"BasedVarlenAttention": {"cuda": repo, "cpu": repo}}, inherit_mapping=False):
        model = kernelize(model, mode=Mode.TRAINING, device=device, use_fallback=False)
    return model, get_kernel(REPO, version=1, trust_remote_code=True)


def train(model, table, device: str, steps: int = 80, seqs: int = 6, min_len: int = 8, max_len: int = 64,
          lr: float = 3e-3, seed: int = 0) -> list[float]:
    """The loss of every AdamW step of next-token prediction on packed batches."""
    vocab = model.head.out_features
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    model.train()
    for inputs, targets, cu_seqlens in packed_batches(table, steps, seqs, min_len, max_len, seed):
        inputs, targets, cu_seqlens = inputs.to(device), targets.to(device), cu_seqlens.to(device)
        with autocast:
            logits = model(inputs, cu_seqlens)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def generate(model, based, prompts: list[torch.Tensor], new_tokens: int):
    """Greedy continuation of every prompt by `new_tokens` tokens: the packed prompts through the forward with
    output_final_state, then one based_decode step a token for all sequences together. Returns the tokens
    (N, new_tokens) and the logits that chose them (N, new_tokens, vocab)."""
    model.eval()
    device = model.head.weight.device
    lengths = torch.tensor([len(p) for p in prompts])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(device, torch.int32)
    logits, states = model(torch.cat(prompts)[None].to(device), cu_seqlens, output_final_state=True)
    step_logits = [logits[0, cu_seqlens[1:] - 1]]
    tokens = [step_logits[-1].argmax(-1)]
    for _ in range(new_tokens - 1):
        logits, states = model.step(tokens[-1][:, None], states, based.based_decode)
        step_logits.append(logits[:, -1])
        tokens.append(step_logits[-1].argmax(-1))
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


def follows_table(table, prompts, generated) -> float:
    """The share of generated transitions that the bigram table allows."""
    ok, total = 0, 0
    for prompt, cont in zip(prompts, generated.cpu()):
        seq = torch.cat([prompt[-1:], cont])
        for a, b in zip(seq[:-1].tolist(), seq[1:].tolist()):
            ok += b in table[a].tolist()
            total += 1
    return ok / total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    vocab, successors = 64, 4
    table = bigram_table(vocab, successors, seed=0)
    model, based = build(args.device, vocab=vocab)
    losses = train(model, table, args.device, args.steps)
    for i in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"step {i:4d}  loss {losses[i]:.4f}")
    print(f"final loss {losses[-1]:.4f} (log vocab {math.log(vocab):.4f}, the language's entropy "
          f"{math.log(successors):.4f} or less)")
    prompts = list(bigram_text(table, 4, 12, torch.Generator().manual_seed(9)))
    prompts = [p[: 4 + 2 * i] for i, p in enumerate(prompts)]  # lengths 4, 6, 8, 10
    generated, _ = generate(model, based, prompts, new_tokens=24)
    for prompt, cont in zip(prompts, generated.tolist()):
        print(f"{prompt.tolist()} -> {cont}")
    print(f"generated transitions the bigram table allows: {follows_table(table, prompts, generated):.0%}")


if __name__ == "__main__":
    main()
