"""Eager Based (2nd-order Taylor linear attention): the forward and its analytic backward, in fp32.

Per batch and head, with q~ = scale * q, s_ij = q~_i . k_j and A_ij = 1 + s_ij + s_ij^2 / 2 for j <= i:

    o_i = num_i / (den_i + 1e-6),    num_i = sum_j A_ij v_j,    den_i = sum_j A_ij.

Both functions work in chunks of CHUNK positions. Inside a chunk they use the quadratic form (the C x C
tile of A); across chunks the feature map phi(x) = [1, x, x (x) x / sqrt(2)] (P = 1 + K + K^2 features),
for which phi(q~) . phi(k) = A. Every chunk's state increment is computed at once and the prefix (forward)
or suffix (backward) sums are cumulative sums over the chunk axis, so there is no Python loop over time;
memory is O(T / CHUNK * P * V) per head. T need not be a multiple of CHUNK: the sequence is zero-padded at
the end, and padded positions only ever feed later (padded) positions.

The backward is the quotient rule written like FlashAttention's: with r_i = 1 / (den_i + 1e-6) and
delta_i = do_i . o_i, the adjoint of A is dA_ij = g_i . v_j + h_i with g_i = r_i do_i (numerator path) and
h_i = -r_i delta_i (normaliser path), so every gradient is one linear-attention backward whose "values"
are [v, 1]:

    dv_j = sum_{i>=j} A_ij g_i,    ds_ij = dA_ij (1 + s_ij),
    dq_i = scale * sum_j ds_ij k_j,    dk_j = sum_i ds_ij q~_i.

Across chunks the same sums go through the reverse state dS = sum_{later i} phi(q~_i) g_i^T and
dz = sum_{later i} phi(q~_i) h_i, and dq through the forward state S = sum_{earlier j} phi(k_j) v_j^T and
z = sum_{earlier j} phi(k_j).
"""

import torch

CHUNK = 64
EPS = 1e-6


def default_scale(K: int) -> float:
    return K**-0.5


def _chunked(x: torch.Tensor, C: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, C, D) in fp32, zero-padded at the end to N * C positions."""
    B, T, H, D = x.shape
    N = -(-T // C)
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B, N, C, H, D).permute(0, 3, 1, 2, 4)


def _unchunked(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H, N, C, D) -> (B, T, H, D), dropping the padding."""
    B, H, N, C, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, D)[:, :T].contiguous()


def _phi(x: torch.Tensor) -> torch.Tensor:
    """[1, x, x (x) x / sqrt(2)] along the last axis."""
    quad = (x[..., :, None] * x[..., None, :]).flatten(-2) * 2**-0.5
    return torch.cat([torch.ones_like(x[..., :1]), x, quad], -1)


def _phi_vjp(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(d phi / d x)^T g for g over the P features: the linear block, plus (G + G^T) x / sqrt(2) from the
    quadratic block G = g[1 + K:] seen as K x K."""
    K = x.shape[-1]
    G = g[..., 1 + K :].unflatten(-1, (K, K))
    return g[..., 1 : 1 + K] + ((G + G.transpose(-1, -2)) @ x[..., None])[..., 0] * 2**-0.5


def _exclusive_cumsum(x: torch.Tensor, dim: int, reverse: bool = False) -> torch.Tensor:
    """sum over the chunks strictly before (or, reversed, strictly after) each chunk."""
    if reverse:
        return _exclusive_cumsum(x.flip(dim), dim).flip(dim)
    return x.cumsum(dim) - x


class _Chunks:
    """The pieces of the chunked forward that the backward reuses."""

    def __init__(self, q, k, v, scale, C):
        self.T = q.shape[1]
        self.q = _chunked(q, C) * scale  # q~
        self.k, self.v = _chunked(k, C), _chunked(v, C)
        self.s = self.q @ self.k.transpose(-1, -2)
        causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
        self.causal = causal
        self.A = (1 + self.s + 0.5 * self.s * self.s).masked_fill(~causal, 0)
        self.phi_q, self.phi_k = _phi(self.q), _phi(self.k)
        # prefix states of the chunks before each chunk: S [B,H,N,P,V], z [B,H,N,P]
        self.S = _exclusive_cumsum(self.phi_k.transpose(-1, -2) @ self.v, 2)
        self.z = _exclusive_cumsum(self.phi_k.sum(-2), 2)
        self.num = self.phi_q @ self.S + self.A @ self.v
        self.den = (self.phi_q @ self.z[..., None])[..., 0] + self.A.sum(-1)


def based_forward_reference(q, k, v, scale=None, chunk: int = CHUNK) -> torch.Tensor:
    """Based forward o (B, T, H, V) in q's dtype; fp32 inside. q, k: (B, T, H, K); v: (B, T, H, V)."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    c = _Chunks(q, k, v, scale, chunk)
    return _unchunked(c.num / (c.den + EPS)[..., None], c.T).to(q.dtype)


def based_backward_reference(q, k, v, do, scale=None, chunk: int = CHUNK):
    """Analytic (dq, dk, dv) of `based_forward_reference` for the incoming gradient do (B, T, H, V), each in
    the dtype of its input; fp32 inside."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    c = _Chunks(q, k, v, scale, chunk)
    do_ = _chunked(do, chunk)
    r = 1.0 / (c.den + EPS)
    delta = (do_ * c.num).sum(-1) * r  # do . o
    g, h = r[..., None] * do_, -r * delta  # numerator / normaliser adjoints
    ds = ((g @ c.v.transpose(-1, -2) + h[..., None]) * (1 + c.s)).masked_fill(~c.causal, 0)

    # reverse states of the chunks after each chunk: dS [B,H,N,P,V], dz [B,H,N,P]
    dS = _exclusive_cumsum(c.phi_q.transpose(-1, -2) @ g, 2, reverse=True)
    dz = _exclusive_cumsum((c.phi_q * h[..., None]).sum(-2), 2, reverse=True)

    dv = c.A.transpose(-1, -2) @ g + c.phi_k @ dS
    dk = ds.transpose(-1, -2) @ c.q + _phi_vjp(c.k, c.v @ dS.transpose(-1, -2) + dz[..., None, :])
    dq_tilde = ds @ c.k + _phi_vjp(c.q, g @ c.S.transpose(-1, -2) + h[..., None] * c.z[..., None, :])
    return (
        _unchunked(scale * dq_tilde, c.T).to(q.dtype),
        _unchunked(dk, c.T).to(k.dtype),
        _unchunked(dv, c.T).to(v.dtype),
    )
