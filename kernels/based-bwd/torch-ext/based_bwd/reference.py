"""Eager Based (2nd-order Taylor linear attention): the forward with state and packed sequences, the decode step,
and the forward's analytic backward. The numerical specification of the package, and its CPU path.

Per sequence and head, with q~ = scale * q, s_ij = q~_i . k_j and A_ij = 1 + s_ij + s_ij^2 / 2 for j <= i:

    o_i = num_i / (den_i + 1e-6),    num_i = phi(q~_i) . S0 + sum_j A_ij v_j,    den_i = phi(q~_i) . z0 + sum_j A_ij.

phi(x) = [1, x, x (x) x / sqrt(2)] (P = 1 + K + K^2 features) is the feature map with phi(q~) . phi(k) = A, and
the state is the pair (S, z): S = sum_j phi(k_j) v_j^T (P x V) and z = sum_j phi(k_j) (P), per sequence and head,
starting from the initial state (S0, z0) (zero when none is given). The final state adds every step of the
sequence to the initial one, so that a call on T1 + T2 steps equals a call on T1 steps whose final state is the
initial state of a call on the next T2.

The forward works in chunks of CHUNK positions. Inside a chunk it uses the quadratic form (the C x C tile of
A); across chunks the feature map. Every chunk's state increment is computed at once and the prefix sums are
cumulative sums over the chunk axis, so there is no Python loop over time; memory is O(T / CHUNK * P * V) per
head. T need not be a multiple of CHUNK: the sequence is zero-padded at the end, and padded positions only ever
feed later (padded) positions and never the final state. Packed sequences (`cu_seqlens`) are laid out as the
rows of a zero-padded batch, one row a sequence, so no sum ever runs across two of them.

A non-finite input at step t changes no output before t: the chunk prefix sums exclude a chunk's own increment
by shifting the inclusive sum (not by subtracting, which turns inf into NaN), and the C x C tile product reads
the values with their non-finite entries zeroed (a masked weight of 0 times inf is NaN) except in the outputs
that such an entry reaches (step t and on), which take the plain product (`_causal_product`).

`based_decode_reference` is the same map in recurrent form, one step at a time. The backward of the stateless
forward is the quotient rule written like FlashAttention's: with r_i = 1 / (den_i + 1e-6) and
delta_i = do_i . o_i, the adjoint of A is dA_ij = g_i . v_j + h_i with g_i = r_i do_i (numerator path) and
h_i = -r_i delta_i (normaliser path), so every gradient is one linear-attention backward whose "values"
are [v, 1]:

    dv_j = sum_{i>=j} A_ij g_i,    ds_ij = dA_ij (1 + s_ij),
    dq_i = scale * sum_j ds_ij k_j,    dk_j = sum_i ds_ij q~_i.

Across chunks the same sums go through the reverse state dS = sum_{later i} phi(q~_i) g_i^T and
dz = sum_{later i} phi(q~_i) h_i, and dq through the forward state S = sum_{earlier j} phi(k_j) v_j^T and
z = sum_{earlier j} phi(k_j). With a state, every reverse state starts from the final state's gradient, and the
initial state's gradient is that plus the reverse sum over every step (`based_state_backward_reference`). Every
path of the package takes its gradients from this backward (the CPU and fp32 ones through the registered ops'
autograd), none from autograd through the forward.

The analytic backward keeps each gradient to the steps it reads. dq_i is o_i's gradient in q_i, which reads the
steps j <= i, so a non-finite q, k or v at step t changes no dq before t (and a non-finite q or do at t no dq
but dq_t); dk_j and dv_j gather the gradients of the outputs i >= j, so a non-finite q or do at step t changes
no dk or dv after t. A non-finite k or v at t makes outputs from t on non-finite, and their gradients reach dk
(and for a k, dv) at every step of the sequence (IEEE: a zero gradient times a non-finite output is NaN), so dk
and dv have no such rule for them; nothing crosses into another batch row or packed sequence. The tile products
of ds k, A^T g and ds^T q~ are `_causal_product`s (the last two in reverse, row j reading the steps i >= j).

Everything computes in float32, or in float64 for float64 inputs (the tests' exact arithmetic), whatever autocast
is on (`autocast_off`).
"""

import torch

from .common.autocast import autocast_off
from .common.checks import bounded_offsets

CHUNK = 64
EPS = 1e-6
# The most new tokens one decode call takes (a prompt longer than this goes through the forward).
MAX_DECODE_TOKENS = 64


def default_scale(K: int) -> float:
    return K**-0.5


def feature_size(K: int) -> int:
    """P, the length of phi(x) for x of size K."""
    return 1 + K + K * K


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunked(x: torch.Tensor, C: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, N, C, D) in `dtype`, zero-padded at the end to N * C positions."""
    B, T, H, D = x.shape
    N = -(-T // C)
    x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, N * C - T))
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
    """sum over the chunks strictly before (or, reversed, strictly after) each chunk: the inclusive sum shifted
    by one chunk, so that a non-finite chunk reaches only the chunks after it."""
    if reverse:
        return _exclusive_cumsum(x.flip(dim), dim).flip(dim)
    inclusive = x.cumsum(dim)
    return torch.cat([torch.zeros_like(inclusive.narrow(dim, 0, 1)), inclusive.narrow(dim, 0, x.shape[dim] - 1)], dim)


def _causal_product(A: torch.Tensor, v: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """A @ v for the causal tile A (zero above the diagonal; reverse: below it, row j reading the rows i >= j)
    without letting a non-finite v_j reach the rows that do not read it: the product of the finite part of v,
    except where a non-finite entry of v's column sits in a row that the row reads (at or before it; reverse: at
    or after it), which takes the plain product."""
    finite = torch.isfinite(v)
    bad = (~finite).to(torch.int32)
    reached = (bad.flip(-2).cumsum(-2).flip(-2) if reverse else bad.cumsum(-2)) > 0
    return torch.where(reached, A @ v, A @ torch.where(finite, v, 0))


class _Chunks:
    """The pieces of the chunked forward that the backward reuses.

    `valid` (B, T) bool marks the positions that count (None: all T), `state` the initial (S0, z0) or None."""

    def __init__(self, q, k, v, scale, C, valid=None, state=None):
        B, T, H, _ = q.shape
        dtype = _compute_dtype(q)
        self.T = T
        self.q = _chunked(q, C, dtype) * scale  # q~
        self.k, self.v = _chunked(k, C, dtype), _chunked(v, C, dtype)
        self.s = self.q @ self.k.transpose(-1, -2)
        causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
        self.causal = causal
        self.A = (1 + self.s + 0.5 * self.s * self.s).masked_fill(~causal, 0)
        self.phi_q, self.phi_k = _phi(self.q), _phi(self.k)
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=q.device)
        counted = _chunked(valid[:, :, None, None], C, torch.bool)  # (B, 1, N, C, 1); padding is False
        # each chunk's state increment over the positions that count: dS [B,H,N,P,V], dz [B,H,N,P]
        phi_k = torch.where(counted, self.phi_k, 0)
        dS, dz = phi_k.transpose(-1, -2) @ self.v, phi_k.sum(-2)
        # prefix states of the chunks before each chunk, from the initial state
        self.S, self.z = _exclusive_cumsum(dS, 2), _exclusive_cumsum(dz, 2)
        if state is not None:
            S0, z0 = (x.to(dtype) for x in state)
            self.S, self.z = self.S + S0[:, :, None], self.z + z0[:, :, None]
        self.final = (self.S[:, :, -1] + dS[:, :, -1], self.z[:, :, -1] + dz[:, :, -1])
        self.num = self.phi_q @ self.S + _causal_product(self.A, self.v)
        self.den = (self.phi_q @ self.z[..., None])[..., 0] + self.A.sum(-1)


def _packed_rows(cu_seqlens: torch.Tensor, T: int):
    """The padded-batch layout of N packed sequences: index (N, L) into the T packed positions and valid (N, L),
    with L the longest sequence (read on the host), of the offsets bounded as the fused path bounds them
    (`common.checks.bounded_offsets`)."""
    cu_seqlens = bounded_offsets(cu_seqlens, T)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    pos = torch.arange(max(1, int(lengths.max())), device=cu_seqlens.device)
    valid = pos < lengths[:, None]
    index = (cu_seqlens[:-1, None].long() + pos).clamp(max=T - 1)
    return index, valid


@autocast_off
def based_forward_reference(
    q, k, v, scale=None, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None, chunk: int = CHUNK
):
    """Based forward o (B, T, H, V) in q's dtype; q, k: (B, T, H, K); v: (B, T, H, V).

    initial_state: None or the pair (S0 (N, H, P, V), z0 (N, H, P)), P = 1 + K + K^2, with N = B, or the number
    of sequences under cu_seqlens. output_final_state: also return the final state, (o, (S, z)) in the compute
    dtype. cu_seqlens: None or the N + 1 offsets (int32/int64, from 0 to T) of N sequences packed along T of a
    B = 1 batch. Differentiable in q, k, v and the initial state through torch autograd (the tests' gradcheck of
    the formula): its gradients are the analytic backward's on finite inputs only, since torch's products carry a
    non-finite value across the masked entries of the bad step's chunk.
    """
    scale = default_scale(q.shape[-1]) if scale is None else scale
    if cu_seqlens is None:
        c = _Chunks(q, k, v, scale, chunk, state=initial_state)
        o = _unchunked(c.num / (c.den + EPS)[..., None], c.T)
    else:
        index, valid = _packed_rows(cu_seqlens, q.shape[1])
        rows = [torch.where(valid[..., None, None], x[0][index], 0) for x in (q, k, v)]  # (N, L, H, D)
        c = _Chunks(*rows, scale, chunk, valid=valid, state=initial_state)
        o = _unchunked(c.num / (c.den + EPS)[..., None], c.T)[valid][None]
    o = o.to(q.dtype)
    return (o, c.final) if output_final_state else o


@autocast_off
def based_decode_reference(q, k, v, state, scale=None):
    """The recurrent form: T new steps (B, T, H, K/V) from the state (S (B, H, P, V), z (B, H, P)), one step at a
    time (write phi(k_t) v_t^T and phi(k_t), then read with phi(q~_t)). Returns o (B, T, H, V) in q's dtype and the
    new state (S, z); the given state is not modified."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    dtype = _compute_dtype(q)
    phi_q, phi_k = _phi(q.to(dtype) * scale), _phi(k.to(dtype))
    v = v.to(dtype)
    S, z = (x.to(dtype) for x in state)
    out = []
    for t in range(q.shape[1]):
        S = S + phi_k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + phi_k[:, t]
        num = (phi_q[:, t, :, None, :] @ S)[..., 0, :]
        den = (phi_q[:, t] * z).sum(-1)
        out.append(num / (den + EPS)[..., None])
    return torch.stack(out, 1).to(q.dtype), (S, z)


def _chunk_grads(c: _Chunks, do_: torch.Tensor, d_final=None):
    """The analytic backward of the chunked forward `c` for the chunked incoming gradient do_: (dq, dk, dv) as
    chunks (B, H, N, C, .) and the gradient of the initial state (dS0, dz0). d_final: None or the gradients
    (dS, dz) of the final state, which every reverse state starts from."""
    r = 1.0 / (c.den + EPS)
    delta = (do_ * c.num).sum(-1) * r  # do . o
    g, h = r[..., None] * do_, -r * delta  # numerator / normaliser adjoints
    ds = ((g @ c.v.transpose(-1, -2) + h[..., None]) * (1 + c.s)).masked_fill(~c.causal, 0)

    # reverse states of the chunks after each chunk: dS [B,H,N,P,V], dz [B,H,N,P]
    step_S, step_z = c.phi_q.transpose(-1, -2) @ g, (c.phi_q * h[..., None]).sum(-2)
    dS, dz = _exclusive_cumsum(step_S, 2, reverse=True), _exclusive_cumsum(step_z, 2, reverse=True)
    dS0, dz0 = step_S.sum(2), step_z.sum(2)
    if d_final is not None:
        dF, dFz = (x.to(dS.dtype) for x in d_final)
        dS, dz, dS0, dz0 = dS + dF[:, :, None], dz + dFz[:, :, None], dS0 + dF, dz0 + dFz

    dv = _causal_product(c.A.transpose(-1, -2), g, reverse=True) + c.phi_k @ dS
    dk = _causal_product(ds.transpose(-1, -2), c.q, reverse=True)
    dk = dk + _phi_vjp(c.k, c.v @ dS.transpose(-1, -2) + dz[..., None, :])
    dq_tilde = _causal_product(ds, c.k) + _phi_vjp(c.q, g @ c.S.transpose(-1, -2) + h[..., None] * c.z[..., None, :])
    return dq_tilde, dk, dv, dS0, dz0


@autocast_off
def based_backward_reference(q, k, v, do, scale=None, chunk: int = CHUNK):
    """Analytic (dq, dk, dv) of the stateless `based_forward_reference` for the incoming gradient do
    (B, T, H, V), each in the dtype of its input."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    c = _Chunks(q, k, v, scale, chunk)
    dq_tilde, dk, dv, _, _ = _chunk_grads(c, _chunked(do, chunk, c.q.dtype))
    return (
        _unchunked(scale * dq_tilde, c.T).to(q.dtype),
        _unchunked(dk, c.T).to(k.dtype),
        _unchunked(dv, c.T).to(v.dtype),
    )


@autocast_off
def based_state_backward_reference(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale=None, chunk: int = CHUNK):
    """Analytic (dq, dk, dv, dS0, dz0) of `based_forward_reference`'s o and final state (S, z), from the initial
    state (S0, z0) ((None, None): zero) over packed sequences cu_seqlens (or None), for their gradients do, dS
    and dz (None or empty: the loss does not see the final state). dS0 and dz0 are the initial state's
    gradients in the compute dtype (empty where none is given); dq, dk, dv in their inputs' dtypes."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    state = None if S0 is None else (S0, z0)
    d_final = None if dS is None or dS.numel() == 0 else (dS, dz)
    if cu_seqlens is None:
        c = _Chunks(q, k, v, scale, chunk, state=state)
        grads = _chunk_grads(c, _chunked(do, chunk, c.q.dtype), d_final)
        dq, dk, dv = (_unchunked(x, c.T) for x in grads[:3])
    else:
        T = q.shape[1]
        index, valid = _packed_rows(cu_seqlens, T)
        rows = [torch.where(valid[..., None, None], x[0][index], 0) for x in (q, k, v, do)]  # (N, L, H, D)
        c = _Chunks(*rows[:3], scale, chunk, valid=valid, state=state)
        grads = _chunk_grads(c, _chunked(rows[3], chunk, c.q.dtype), d_final)

        def packed(x):  # (N, H, n, C, D) chunks of the rows -> (1, T, H, D) at the packed positions
            x = _unchunked(x, c.T)
            return x.new_zeros(T, *x.shape[2:]).index_put((index[valid],), x[valid])[None]

        dq, dk, dv = (packed(x) for x in grads[:3])
    dS0, dz0 = grads[3:] if state is not None else (c.q.new_empty(0), c.q.new_empty(0))
    return (scale * dq).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dz0
