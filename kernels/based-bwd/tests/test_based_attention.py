"""A training example: a small causal language model with Based attention (random init, synthetic data, no
download), trained through `kernelize` in TRAINING mode with the Hub layer, against the same model trained with
its own pure-torch attention on the CPU; the loss curves must match.

The model: token embedding, two pre-norm blocks (Based attention over projected q, k (K = 16) and v, then an
MLP), a final norm and an output head. Attention runs on bf16 q, k, v (the fused kernels' dtype; the host
attention rounds the same way). The data: sequences of a fixed random Markov chain (four successors a token),
whose entropy, about 1.3 nats a token, is the loss a trained model approaches from log(64) = 4.2.

    python -m pytest kernels/based-bwd/tests/test_based_attention.py     # the GPU part runs where CUDA is
"""

import copy

import torch
from torch import nn

from testkit import needs_cuda

VOCAB, D, H, K, V, T = 64, 64, 4, 16, 16, 128


def based_attention_torch(q, k, v, scale):
    """The host's attention: the quadratic form over the full T x T causal weights, fp32 inside."""
    dtype = q.dtype
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    s = (scale * q) @ k.transpose(-1, -2)
    A = torch.tril(1 + s + 0.5 * s * s)
    return ((A @ v) / (A.sum(-1, keepdim=True) + 1e-6)).transpose(1, 2).to(dtype)


def host_attention_class():
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("BasedAttention")
    class BasedAttention(nn.Module):
        def __init__(self, scale=None):
            super().__init__()
            self.scale = scale

        def forward(self, q, k, v):
            return based_attention_torch(q, k, v, q.shape[-1] ** -0.5 if self.scale is None else self.scale)

    return BasedAttention


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, H * (2 * K + V), bias=False)
        self.out = nn.Linear(H * V, D, bias=False)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.attn = attention()

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, H, -1).split([K, K, V], -1)
        o = self.attn(*(t.to(torch.bfloat16).contiguous() for t in (q, k, v)))
        x = x + self.out(o.float().reshape(B, L, H * V))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        attention = host_attention_class()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(steps, batch=16, length=T, seed=0):
    """Markov-chain sequences: four successors a token, with fixed random odds."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    odds = torch.rand(VOCAB, 4, generator=g) + 0.2
    for _ in range(steps):
        x = torch.empty(batch, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for t in range(1, length):
            pick = torch.multinomial(odds[x[:, t - 1]], 1, generator=g)[:, 0]
            x[:, t] = successors[x[:, t - 1], pick]
        yield x


def train(model, device, steps, length=T):
    """Losses of `steps` AdamW steps of next-token prediction."""
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in batches(steps, length=length):
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def kernelized(model, device):
    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping

    repo = LayerRepository("tessera/based-bwd", layer_name="BasedAttention", version=1, trust_remote_code=True)
    with use_kernel_mapping({"BasedAttention": {device: repo}}, inherit_mapping=False):
        kernelize(model.to(device), mode=Mode.TRAINING, device=device, use_fallback=False)
    assert all(b.attn.forward.__func__.__module__.endswith(".layers") for b in model.blocks)
    return model


def test_training_on_cpu_matches_the_host_model(based):
    """A short run on the CPU: the kernelized model (the Hub layer's eager path) and the host model lose alike."""
    torch.manual_seed(0)
    host = CausalLM()
    hub = kernelized(copy.deepcopy(host), "cpu")
    ours, theirs = train(hub, "cpu", 12, length=64), train(host, "cpu", 12, length=64)
    assert (ours - theirs).abs().max() < 2e-3
    assert ours[-1] < ours[0] - 0.3  # it trains


@needs_cuda
def test_training_on_cuda_matches_the_cpu_reference(based):
    """300 steps on the GPU through the fused kernels (kernelize, TRAINING) against the host model on the CPU:
    the loss curves agree within 2% over every window of 25 steps, and the model learns the chain."""
    torch.manual_seed(0)
    host = CausalLM()
    hub = kernelized(copy.deepcopy(host), "cuda")
    steps = 300
    ours, theirs = train(hub, "cuda", steps), train(host, "cpu", steps)
    assert torch.isfinite(ours).all()
    windows = ours.view(-1, 25).mean(1), theirs.view(-1, 25).mean(1)
    assert ((windows[0] - windows[1]).abs() / windows[1]).max() < 2e-2, (windows[0], windows[1])
    assert windows[0][-1] < 1.6 and windows[0][-1] < windows[0][0] - 0.5
