"""Train a small causal language model with Comba attention from a random init (no download), through kernelize.

    python train_causal_lm.py --device cuda          # the fused forward and backward (comba-bwd's layer)
    python train_causal_lm.py --device cpu           # the same layer on the CPU: the eager reference

The layer comes from the Hub (`tessera/comba-bwd`, version 1). To take it from the repo's local Hub cache instead,
from any directory, after `make hub` in the repo root <repo>:

    HF_HUB_OFFLINE=1 HF_HUB_CACHE=<repo>/.hub python <repo>/kernels/comba-bwd/examples/train_causal_lm.py --device cpu

The model's token mixer is a host module decorated with `use_kernel_forward_from_hub("CombaAttention")`;
`kernelize(..., mode=Mode.TRAINING)` replaces its forward by comba-bwd's `CombaAttention` layer on either device.
The data is a fixed random bigram language (each token has a few likely successors), made on the CPU from the
seed, so that both devices see the same batches and the loss falls from log(vocab) toward the language's entropy.
On CUDA the model runs under bf16 autocast (the kernel's operands are bf16 there); the log-decay g stays float32.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

REPO = "tessera/comba-bwd"


def comba_recurrence(q, k, v, p, beta, g, scale=None):
    """The Comba recurrence one step at a time (the host's own forward, before kernelize replaces it): decay the
    state, read it with p, write with k, read the output with q."""
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = g[:, t, :, None, None].exp() * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, p[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t]))
    return torch.stack(out, 1)


def make_mixer_class():
    """The host token mixer, decorated for kernelize (made in a function so that importing this file needs no
    `kernels`)."""
    from kernels import use_kernel_forward_from_hub

    @use_kernel_forward_from_hub("CombaAttention")
    class CombaMixer(nn.Module):
        def forward(self, q, k, v, p, beta, g):
            return comba_recurrence(q, k, v, p, beta, g)

    return CombaMixer


class CombaBlock(nn.Module):
    """Pre-norm block: Comba attention (q, k, v, p projections, unit-norm k and p, beta = sigmoid, log-decay
    g = logsigmoid / 8 in float32) and a two-layer MLP."""

    def __init__(self, mixer_cls, d_model: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm1 = nn.RMSNorm(d_model)
        self.qkvp = nn.Linear(d_model, 4 * heads * head_dim, bias=False)
        self.gates = nn.Linear(d_model, 2 * heads)
        self.mixer = mixer_cls()
        self.out = nn.Linear(heads * head_dim, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q, k, v, p = self.qkvp(h).view(B, T, 4, self.heads, self.head_dim).unbind(2)
        # one dtype for q, k, v and p (under autocast the projections are bf16 and normalize is fp32)
        k, p = F.normalize(k, dim=-1).to(q.dtype), F.normalize(p, dim=-1).to(q.dtype)
        beta_logit, decay_logit = self.gates(h).view(B, T, 2, self.heads).unbind(2)
        g = F.logsigmoid(decay_logit.float()) / 8
        o = self.mixer(q.contiguous(), k.contiguous(), v.contiguous(), p.contiguous(), beta_logit.sigmoid(), g)
        x = x + self.out(o.reshape(B, T, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, mixer_cls, vocab: int, d_model: int, heads: int, head_dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(CombaBlock(mixer_cls, d_model, heads, head_dim) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def bigram_batches(steps: int, batch: int, seq: int, vocab: int, successors: int, seed: int):
    """`steps` batches (batch, seq + 1) of a fixed random bigram language, made on the CPU from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, successors), generator=gen)
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        pick = torch.randint(0, successors, (batch, seq), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = table[tokens[:, t], pick[:, t]]
        yield tokens


def train(device: str, steps: int = 300, batch: int = 8, seq: int = 128, vocab: int = 256, d_model: int = 128,
          heads: int = 1, head_dim: int = 128, layers: int = 2, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """The loss of every step of a training run on `device`, the model kernelized in TRAINING mode."""
    from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping

    torch.manual_seed(seed)
    model = TinyLM(make_mixer_class(), vocab, d_model, heads, head_dim, layers)  # the same init on every device
    model = model.to(device)
    repo = LayerRepository(REPO, layer_name="CombaAttention", version=1, trust_remote_code=True)
    with use_kernel_mapping({"CombaAttention": {"cuda": repo, "cpu": repo}}, inherit_mapping=False):
        model = kernelize(model, mode=Mode.TRAINING, device=device, use_fallback=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    for tokens in bigram_batches(steps, batch, seq, vocab, successors=4, seed=seed):
        tokens = tokens.to(device)
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    losses = train(args.device, args.steps)
    for i in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"step {i:4d}  loss {losses[i]:.4f}")
    print(f"final loss {losses[-1]:.4f} (log vocab {math.log(256):.4f}, the language's entropy {math.log(4):.4f})")


if __name__ == "__main__":
    main()
