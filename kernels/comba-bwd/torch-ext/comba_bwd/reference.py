"""Eager fp32 reference for Comba: the chunked forward and its analytic chunked backward (torch only).

The recurrence (per batch b and head h, state S of shape (K, V) starting at zero, spec convention:
the decay comes BEFORE the read):

    S   = exp(g_t) S
    u_t = beta_t (v_t - S^T p_t)        # read with p
    S   = S + k_t u_t^T                 # write with k
    o_t = S^T (scale q_t)

Chunked form (chunk length C = 64), with gc the inclusive cumsum of g inside a chunk, gam_i = exp(gc_i),
Gam = exp(gc_{C-1}), E_ij = exp(gc_i - gc_j) for j <= i (0 above the diagonal) and S the chunk-start state:

    L  = strict_lower((beta P) K^T * E)         non-symmetric: P on the rows, K on the columns
    U  = (I + L)^-1 (beta V),  W = (I + L)^-1 (beta gam P)        (forward substitution)
    Vn = U - W S                                the corrected values of the chunk
    O  = scale [(gam Q) S + (lower(Q K^T) * E) Vn]
    S' = Gam S + (K * Gam / gam)^T Vn

The backward runs the same phases in the order a chunk-parallel kernel runs them: the chunk transform, a
forward scan that keeps every chunk-start state S_n, a reverse scan that keeps every dS'_n (the gradient
with respect to the state after chunk n) and dVn, then every chunk's gradients independently. Two identities
keep the adjoint of the chunk transform to ONE backward substitution, X = (I + L)^-T dVn:
    (I + L)^-T dW = -X S^T          (since dW = -dVn S^T)
    dL = -strict_lower(X U^T + Y W^T) = -strict_lower(X Vn^T)      (Y = -X S^T, Vn = U - W S)

Every decay is formed from a difference of cumulative sums before exp (exp(gc_{C-1} - gc_j), and
exp(gc_i - gc_j) masked to -inf above the diagonal before exp), never as a ratio of two exps: once a chunk's
summed log-decay passes about -104, gam and Gam underflow to 0 in fp32 and Gam / gam would be 0 / 0, while
the difference stays finite and every factor stays <= 1.

A per-step log-decay below G_FLOOR is taken as G_FLOOR, on every path, without looking at the values (no
device sync, so calls stay capturable in CUDA graphs): exp(G_FLOOR) is exactly 0 in fp32, so such a step,
g = -inf included, is a hard reset of the state, and the recurrence cannot meet -inf - (-inf). dg is 0 at
those steps, as exp(g) is: g_t enters the loss only through exp(g_t) S_{t-1}.

Any T is accepted: the sequence is zero-padded to a multiple of C. Padding at the end is exact, because the
recurrence is causal and a zero `do` on the padded steps adds nothing to the loss.
"""

import torch

CHUNK = 64
# The floor on a step's log-decay: the largest whole number whose exp rounds to 0.0 in fp32 (exp(x) does for
# x below ln(2^-150) = -103.972, half the smallest subnormal). Finite g above it is untouched; below it exp(g)
# is 0 in fp32 whatever the value, so the floor changes no result beyond fp32 rounding, and it keeps |gc|, and
# with it the rounding of the gc differences later in the chunk, as small as a reset allows.
G_FLOOR = -104.0


def floor_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g with every step below G_FLOOR (-inf included) set to G_FLOOR: a hard reset, exp(G_FLOOR) = 0 in fp32."""
    return g.clamp_min(G_FLOOR)


def pad_time(x: torch.Tensor, multiple: int = CHUNK) -> torch.Tensor:
    """Zero-pad dim 1 (time) of x to a multiple of `multiple`; x itself when it already is one."""
    extra = -x.shape[1] % multiple
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)


def _to_chunks(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, ...) -> (B, H, N, C, ...) in float32 (T is a multiple of CHUNK)."""
    B, T, H = x.shape[:3]
    return x.float().reshape(B, T // CHUNK, CHUNK, H, *x.shape[3:]).movedim(3, 1)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H, N, C, ...) -> (B, T, H, ...), dropping the time padding."""
    B, H, N, C = x.shape[:4]
    return x.movedim(1, 3).reshape(B, N * C, H, *x.shape[4:])[:, :T].contiguous()


def _chunk_transform(k, p, v, beta, g):
    """gc, E, L, U, W of every chunk (all (B, H, N, ...) float32)."""
    gc = g.cumsum(-1)
    C = gc.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril()
    # Mask the exponent, not the result: above the diagonal gc_i - gc_j >= 0 and could overflow.
    E = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    L = (((beta[..., None] * p) @ k.mT) * E).tril(-1)
    IL = L + torch.eye(C, dtype=L.dtype, device=L.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gc.exp())[..., None] * p], dim=-1)
    UW = torch.linalg.solve_triangular(IL, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], p.shape[-1]], dim=-1)
    return gc, E, L, IL, U, W


def _to_end(gc):
    """Gam / gam = exp(gc_{C-1} - gc_j), the decay from step j to the chunk's end, as one exp of a difference."""
    return (gc[..., -1:] - gc).exp()


def _forward_scan(k, gc, U, W):
    """Chunk-start states S_n (B, H, N, K, V) and corrected values Vn (B, H, N, C, V)."""
    B, H, N, C, K = k.shape
    S = k.new_zeros(B, H, K, U.shape[-1])
    gam_last = gc[..., -1].exp()
    k_to_end = k * _to_end(gc)[..., None]                    # K * Gam / gam: decay from step j to chunk end
    states, vns = [], []
    for n in range(N):
        states.append(S)
        Vn = U[:, :, n] - W[:, :, n] @ S
        vns.append(Vn)
        S = gam_last[:, :, n, None, None] * S + k_to_end[:, :, n].mT @ Vn
    return torch.stack(states, 2), torch.stack(vns, 2)


def _resolve_scale(scale, K: int) -> float:
    return K**-0.5 if scale is None else float(scale)


def comba_forward_reference(q, k, v, p, beta, g, scale=None) -> torch.Tensor:
    """Comba forward o (B, T, H, V) in v's dtype; computed in float32, chunked."""
    T, dtype = q.shape[1], v.dtype
    scale = _resolve_scale(scale, q.shape[-1])
    g = floor_log_decay(g)
    q, k, v, p, beta, g = (_to_chunks(pad_time(x)) for x in (q, k, v, p, beta, g))
    gc, E, _, _, U, W = _chunk_transform(k, p, v, beta, g)
    S, Vn = _forward_scan(k, gc, U, W)
    qs = q * scale
    o = (gc.exp()[..., None] * qs) @ S + ((qs @ k.mT) * E) @ Vn
    return _from_chunks(o, T).to(dtype)


def comba_backward_reference(q, k, v, p, beta, g, do, scale=None):
    """Analytic Comba backward, float32: (dq, dk, dv, dp, dbeta, dg), all float32.

    Same arguments as the spec's `comba_backward`: q, k, p (B, T, H, K); v, do (B, T, H, V); beta, g (B, T, H).
    g is floored at G_FLOOR first, and dg is 0 where the floored g is at the floor (there exp(g) is 0 in fp32).
    """
    T = q.shape[1]
    scale = _resolve_scale(scale, q.shape[-1])
    g = floor_log_decay(g)
    reset = g <= G_FLOOR
    q, k, v, p, beta, g, do = (_to_chunks(pad_time(x)) for x in (q, k, v, p, beta, g, do))
    gc, E, L, IL, U, W = _chunk_transform(k, p, v, beta, g)
    S, Vn = _forward_scan(k, gc, U, W)
    gam = gc.exp()
    gam_last = gam[..., -1]
    to_end = _to_end(gc)                                       # Gam / gam, never formed as a ratio
    k_to_end = k * to_end[..., None]
    qs = q * scale
    scores = (qs @ k.mT) * E                                   # lower(scale Q K^T) * E

    # Reverse scan: dS' of each chunk and the gradient dVn of its corrected values.
    N = q.shape[2]
    dS = torch.zeros_like(S[:, :, 0])
    dS_next, dVn = [None] * N, [None] * N
    for n in reversed(range(N)):
        dS_next[n] = dS
        dVn[n] = scores[:, :, n].mT @ do[:, :, n] + k_to_end[:, :, n] @ dS
        dS = (gam_last[:, :, n, None, None] * dS + (gam[:, :, n, :, None] * qs[:, :, n]).mT @ do[:, :, n]
              - W[:, :, n].mT @ dVn[n])
    dS_next, dVn = torch.stack(dS_next, 2), torch.stack(dVn, 2)

    # Chunk-parallel gradients.
    X = torch.linalg.solve_triangular(IL.mT, dVn, upper=True, unitriangular=True)   # (I + L)^-T dVn
    Y = -X @ S.mT                                                                     # (I + L)^-T dW
    dv = beta[..., None] * X
    do_vn = (do @ Vn.mT) * E                                   # lower(dO Vn^T) * E
    dq = scale * (gam[..., None] * (do @ S.mT) + do_vn @ k)
    dk_read = scale * (do_vn.mT @ q)
    dk_state = to_end[..., None] * (Vn @ dS_next.mT)
    dL = -(X @ Vn.mT).tril(-1)
    dR = dL * E                                                # gradient of the raw (beta P) K^T
    dR_k = dR @ k
    dp = (beta * gam)[..., None] * Y + beta[..., None] * dR_k
    dk = dk_read + dk_state + dR.mT @ (beta[..., None] * p)
    dbeta = (v * X).sum(-1) + gam * (p * Y).sum(-1) + (p * dR_k).sum(-1)
    dL_L = dL * L
    dgc = (dL_L.sum(-1) - dL_L.sum(-2) + beta * gam * (p * Y).sum(-1)
           + (q * dq).sum(-1) - (k * (dk_read + dk_state)).sum(-1))
    last = (k * dk_state).sum((-1, -2)) + gam_last * (S * dS_next).sum((-1, -2))
    dgc = torch.cat([dgc[..., :-1], dgc[..., -1:] + last[..., None]], dim=-1)
    dg = dgc.flip(-1).cumsum(-1).flip(-1)                      # g_t feeds every gc_i with i >= t
    dq, dk, dv, dp, dbeta, dg = (_from_chunks(x, T) for x in (dq, dk, dv, dp, dbeta, dg))
    # At the floor the reverse cumsum leaves only the rounding of terms that cancel; the gradient is exp(g_t)
    # times a finite product, 0 in fp32.
    return dq, dk, dv, dp, dbeta, dg.masked_fill(reset, 0.0)
