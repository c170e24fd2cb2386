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
recurrence is causal and a zero `do` on the padded steps adds nothing to the loss, and it leaves the final state
as it is (a padded step has beta = 0 and g = 0).

The forward takes what a model's layer needs (`comba_forward_reference`'s keyword arguments): a carried state in
and out, packed sequences (`cu_seqlens`), value heads grouped over the query heads (HV a multiple of H: value head
hv reads q, k and p of head hv // (HV / H)), q, k and p L2-normalised inside, and fla's read order, where the read
sees the state before the step's decay:

    u_t = beta_t (v_t - S^T p_t)        # read before the decay ("fla")
    S   = exp(g_t) S + k_t u_t^T
    o_t = S^T (scale q_t)

which is the chunked form above with the read's decay exp(gr_i - gc_j), gr the exclusive cumsum (gr_i = gc_{i-1}),
in L and W: every factor stays <= 1, where emulating it through the spec's order (p / exp(g_t)) overflows.

Two rules on values hold on every reference forward (this module's and recurrent.py's), the first in the analytic
backward too:
- g is a log-decay, g <= 0: a call with g > 0 anywhere raises ValueError. The chunked form, whose factors are all
  <= 1 only for g <= 0, overflows to inf - inf at growing decays where the recurrence stays finite.
- A non-finite input (q, k, v, p, beta or g NaN or inf; g = -inf is a reset, not an error) at step t of one
  sequence and value head changes no output before t and nothing of another sequence or head: o from t on and
  that sequence's final state are NaN. The chunked products mix a chunk's steps (a zero weight times NaN is NaN),
  so the inputs are zeroed there, the call computed, and the NaN put back from t on.

Every reference computes in float32 whatever autocast is on (`autocast_off` switches it off for the call).
"""

import torch

from .common.autocast import autocast_off

CHUNK = 64
# The floor on a step's log-decay: the largest whole number whose exp rounds to 0.0 in fp32 (exp(x) does for
# x below ln(2^-150) = -103.972, half the smallest subnormal). Finite g above it is untouched; below it exp(g)
# is 0 in fp32 whatever the value, so the floor changes no result beyond fp32 rounding, and it keeps |gc|, and
# with it the rounding of the gc differences later in the chunk, as small as a reset allows.
G_FLOOR = -104.0
# The read orders: the spec's (decay, then read) and fla's (read, then decay).
READ_ORDERS = ("decay_first", "fla")
# q, k and p L2-normalised inside: x / sqrt(sum(x^2) + L2NORM_EPS), fla's `use_qk_l2norm_in_kernel`.
L2NORM_EPS = 1e-6


def floor_log_decay(g: torch.Tensor) -> torch.Tensor:
    """g with every step below G_FLOOR (-inf included) set to G_FLOOR: a hard reset, exp(G_FLOOR) = 0 in fp32."""
    return g.clamp_min(G_FLOOR)


def check_log_decay(g: torch.Tensor) -> None:
    """Raise ValueError if any g > 0 (the module docstring says why); reads g's values."""
    if bool((g > 0).any()):
        raise ValueError(f"g must be a log-decay <= 0 (-inf a hard reset), got a largest value of {g.max().item()}")


def check_read_order(read_order) -> None:
    if read_order not in READ_ORDERS:
        raise ValueError(f"read_order must be one of {READ_ORDERS}, got {read_order!r}")


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + L2NORM_EPS) over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def l2_normalised_backward(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient at x of `l2_normalised` given dy, in float32: r (dy - y (dy . y)) with
    r = rsqrt(sum(x^2) + L2NORM_EPS) and y = x r."""
    x, dy = x.float(), dy.float()
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def pad_time(x: torch.Tensor, multiple: int = CHUNK) -> torch.Tensor:
    """Zero-pad dim 1 (time) of x to a multiple of `multiple`; x itself when it already is one."""
    extra = -x.shape[1] % multiple
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)


def sequence_bounds(cu_seqlens: torch.Tensor, T: int) -> list[tuple[int, int]]:
    """The (start, end) of every packed sequence of `cu_seqlens` (N + 1 offsets, 0 first, T last, non-decreasing);
    reads its values."""
    offsets = cu_seqlens.tolist()
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {offsets[:1]} ... {offsets[-1:]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    return list(zip(offsets, offsets[1:]))


def unpack(x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """(1, T, ...) sequences packed at `bounds` (`sequence_bounds`) -> (N, longest, ...), each zero-padded at its
    end."""
    longest = max(b - a for a, b in bounds)
    return torch.stack([torch.cat([x[0, a:b], x.new_zeros(longest - (b - a), *x.shape[2:])]) for a, b in bounds])


def repack(x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """(N, T', ...) one sequence a row -> (1, T, ...) packed at `bounds`: `unpack`'s inverse."""
    return torch.cat([x[i, :b - a] for i, (a, b) in enumerate(bounds)])[None]


class Sequences:
    """A call's inputs as the recurrence takes them: float32, q, k and p L2-normalised if asked and repeated to the
    HV value heads, one row per sequence (packed sequences unpacked) zero-padded in time to `multiple`, g floored,
    and every non-finite input zeroed; `poisoned` (N, Tp, HV) marks the steps at and after a sequence and value
    head's first non-finite input, whose outputs are NaN (the module docstring)."""

    def __init__(self, q, k, v, p, beta, g, cu_seqlens=None, use_qk_l2norm=False, multiple=CHUNK):
        self.T = q.shape[1]
        q, k, v, p, beta, g = (x.float() for x in (q, k, v, p, beta, g))
        if use_qk_l2norm:
            q, k, p = (l2_normalised(x) for x in (q, k, p))
        group = v.shape[2] // q.shape[2]
        if group > 1:
            q, k, p = (x.repeat_interleave(group, dim=2) for x in (q, k, p))
        self.bounds = None if cu_seqlens is None else sequence_bounds(cu_seqlens, self.T)
        q, k, v, p, beta, g = (pad_time(self._unpack(x), multiple) for x in (q, k, v, p, beta, g))
        g = floor_log_decay(g)
        finite = [x.isfinite() for x in (q, k, v, p, beta, g)]
        bad = ~(finite[4] & finite[5])
        for f in finite[:4]:
            bad |= ~f.all(-1)
        self.poisoned = bad.cumsum(1) > 0
        self.q, self.k, self.v, self.p, self.beta, self.g = (
            torch.where(f, x, 0.0) for f, x in zip(finite, (q, k, v, p, beta, g)))

    def _unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) packed sequences -> (N, longest, ...) zero-padded (`unpack`); x itself without cu_seqlens."""
        return x if self.bounds is None else unpack(x, self.bounds)

    def outputs(self, o: torch.Tensor, state: torch.Tensor):
        """o (N, Tp, HV, V) -> (B, T, HV, V) with NaN from each first non-finite input on, and the final states
        (N, HV, K, V), NaN where their sequence had one."""
        o = torch.where(self.poisoned[..., None], float("nan"), o)
        state = torch.where(self.poisoned[:, -1, :, None, None], float("nan"), state)
        if self.bounds is None:
            return o[:, :self.T], state
        return repack(o, self.bounds), state


def initial_states(initial_state, N: int, HV: int, K: int, V: int, device) -> torch.Tensor:
    """The (N, HV, K, V) float32 state each sequence starts from: `initial_state`, or zeros."""
    if initial_state is None:
        return torch.zeros(N, HV, K, V, device=device)
    return initial_state.float()


def _to_chunks(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, ...) -> (B, H, N, C, ...) in float32 (T is a multiple of CHUNK)."""
    B, T, H = x.shape[:3]
    return x.float().reshape(B, T // CHUNK, CHUNK, H, *x.shape[3:]).movedim(3, 1)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H, N, C, ...) -> (B, T, H, ...), dropping the time padding."""
    B, H, N, C = x.shape[:4]
    return x.movedim(1, 3).reshape(B, N * C, H, *x.shape[4:])[:, :T].contiguous()


def _chunk_transform(k, p, v, beta, g, read_first=False):
    """gc, gr, E, E_read, L, I + L, U, W of every chunk (all (B, H, N, ...) float32). read_first: fla's order, the
    read's decay E_read = exp(gr_i - gc_j) (j < i) with gr the exclusive cumsum, in L and W; else gr = gc and
    E_read = E."""
    gc = g.cumsum(-1)
    C = gc.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril()
    # Mask the exponent, not the result: above the diagonal gc_i - gc_j >= 0 and could overflow.
    E = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    if read_first:
        gr = torch.cat([torch.zeros_like(gc[..., :1]), gc[..., :-1]], dim=-1)
        E_read = (gr[..., :, None] - gc[..., None, :]).masked_fill(~lower.tril(-1), float("-inf")).exp()
    else:
        gr, E_read = gc, E
    L = (((beta[..., None] * p) @ k.mT) * E_read).tril(-1)
    IL = L + torch.eye(C, dtype=L.dtype, device=L.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gr.exp())[..., None] * p], dim=-1)
    UW = torch.linalg.solve_triangular(IL, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], p.shape[-1]], dim=-1)
    return gc, gr, E, E_read, L, IL, U, W


def _to_end(gc):
    """Gam / gam = exp(gc_{C-1} - gc_j), the decay from step j to the chunk's end, as one exp of a difference."""
    return (gc[..., -1:] - gc).exp()


def _forward_scan(k, gc, U, W, S=None):
    """Chunk-start states S_n (B, H, N, K, V), corrected values Vn (B, H, N, C, V) and the state after the last
    chunk (B, H, K, V), from the state S (zeros if None)."""
    B, H, N, C, K = k.shape
    if S is None:
        S = k.new_zeros(B, H, K, U.shape[-1])
    gam_last = gc[..., -1].exp()
    k_to_end = k * _to_end(gc)[..., None]                    # K * Gam / gam: decay from step j to chunk end
    states, vns = [], []
    for n in range(N):
        states.append(S)
        Vn = U[:, :, n] - W[:, :, n] @ S
        vns.append(Vn)
        S = gam_last[:, :, n, None, None] * S + k_to_end[:, :, n].mT @ Vn
    return torch.stack(states, 2), torch.stack(vns, 2), S


def resolve_scale(scale, K: int) -> float:
    return K**-0.5 if scale is None else float(scale)


@autocast_off
def comba_forward_reference(q, k, v, p, beta, g, scale=None, *, initial_state=None, output_final_state=False,
                            cu_seqlens=None, use_qk_l2norm=False, read_order="decay_first"):
    """Comba forward, computed in float32, chunked; differentiable (by autograd) in every tensor.

    q, k, p (B, T, H, K); v (B, T, HV, V) with HV a multiple of H; beta, g (B, T, HV); scale: float or None
    (K ** -0.5). initial_state: (N, HV, K, V) or None (zeros), N = B, or the number of sequences with cu_seqlens:
    (N + 1,) offsets of N sequences packed along T of a batch of one (B = 1). use_qk_l2norm: L2-normalise q, k
    and p first. read_order: "decay_first" (the spec's) or "fla" (the read before the step's decay).
    Returns o (B, T, HV, V) in v's dtype, and with output_final_state=True (o, final_state (N, HV, K, V) float32).
    g > 0 raises ValueError; non-finite inputs follow the module docstring's rule.
    """
    check_log_decay(g)
    check_read_order(read_order)
    dtype, K, V, HV = v.dtype, q.shape[-1], v.shape[-1], v.shape[2]
    x = Sequences(q, k, v, p, beta, g, cu_seqlens, use_qk_l2norm)
    S0 = initial_states(initial_state, x.q.shape[0], HV, K, V, q.device)
    T = x.q.shape[1]
    qc, kc, vc, pc, bc, gcs = (_to_chunks(t) for t in (x.q, x.k, x.v, x.p, x.beta, x.g))
    gc, _, E, _, _, _, U, W = _chunk_transform(kc, pc, vc, bc, gcs, read_first=read_order == "fla")
    S, Vn, final = _forward_scan(kc, gc, U, W, S0)
    qs = qc * resolve_scale(scale, K)
    o = (gc.exp()[..., None] * qs) @ S + ((qs @ kc.mT) * E) @ Vn
    o, final = x.outputs(_from_chunks(o, T), final)
    return (o.to(dtype), final) if output_final_state else o.to(dtype)


@autocast_off
def comba_backward_reference(q, k, v, p, beta, g, do, scale=None):
    """Analytic Comba backward, float32: (dq, dk, dv, dp, dbeta, dg), all float32.

    Same arguments as the spec's `comba_backward`: q, k, p (B, T, H, K); v, do (B, T, H, V); beta, g (B, T, H).
    g > 0 raises ValueError (the module docstring). g is floored at G_FLOOR first, and dg is 0 where the floored g is
    at the floor (there exp(g) is 0 in fp32).
    """
    check_log_decay(g)
    return _chunked_backward(q, k, v, p, beta, g, do, scale)[:6]


def _chunked_backward(q, k, v, p, beta, g, do, scale, initial_state=None, d_final=None, read_first=False):
    """The analytic backward of `comba_backward_reference` from a carried state: (dq, dk, dv, dp, dbeta, dg, the
    initial state's gradient), the scans starting from initial_state and from d_final, the final state's gradient
    ((B, H, K, V) each, None: zeros). read_first: fla's read order, whose L and W take the read's log-decay
    gr = gc - g: their terms of d gr reach dg as d gc's do, less at the step itself (g_t feeds gr_i for i > t)."""
    T = q.shape[1]
    scale = resolve_scale(scale, q.shape[-1])
    g = floor_log_decay(g)
    reset = g <= G_FLOOR
    q, k, v, p, beta, g, do = (_to_chunks(pad_time(x)) for x in (q, k, v, p, beta, g, do))
    gc, gr, E, E_read, L, IL, U, W = _chunk_transform(k, p, v, beta, g, read_first)
    S, Vn, _ = _forward_scan(k, gc, U, W, None if initial_state is None else initial_state.float())
    gam = gc.exp()
    gam_last = gam[..., -1]
    to_end = _to_end(gc)                                       # Gam / gam, never formed as a ratio
    k_to_end = k * to_end[..., None]
    qs = q * scale
    scores = (qs @ k.mT) * E                                   # lower(scale Q K^T) * E

    # Reverse scan: dS' of each chunk and the gradient dVn of its corrected values.
    N = q.shape[2]
    dS = torch.zeros_like(S[:, :, 0]) if d_final is None else d_final.float()
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
    dR = dL * E_read                                           # gradient of the raw (beta P) K^T
    dR_k = dR @ k
    gam_read = gr.exp()                                        # the read's decay, W's (gam in the spec's order)
    dp = (beta * gam_read)[..., None] * Y + beta[..., None] * dR_k
    dk = dk_read + dk_state + dR.mT @ (beta[..., None] * p)
    dbeta = (v * X).sum(-1) + gam_read * (p * Y).sum(-1) + (p * dR_k).sum(-1)
    dL_L = dL * L
    d_read = dL_L.sum(-1) + beta * gam_read * (p * Y).sum(-1)  # d gr (part of d gc in the spec's order)
    dgc = d_read - dL_L.sum(-2) + (q * dq).sum(-1) - (k * (dk_read + dk_state)).sum(-1)
    last = (k * dk_state).sum((-1, -2)) + gam_last * (S * dS_next).sum((-1, -2))
    dgc = torch.cat([dgc[..., :-1], dgc[..., -1:] + last[..., None]], dim=-1)
    dg = dgc.flip(-1).cumsum(-1).flip(-1)                      # g_t feeds every gc_i with i >= t
    if read_first:
        dg = dg - d_read                                       # and gr_i only with i > t
    dq, dk, dv, dp, dbeta, dg = (_from_chunks(x, T) for x in (dq, dk, dv, dp, dbeta, dg))
    # At the floor the reverse cumsum leaves only the rounding of terms that cancel; the gradient is exp(g_t)
    # times a finite product, 0 in fp32.
    return dq, dk, dv, dp, dbeta, dg.masked_fill(reset, 0.0), dS


def comba_state_forward_reference(q, k, v, p, beta, g, initial_state, scale, output_final_state, cu_seqlens=None,
                                  read_order="decay_first", use_qk_l2norm=False):
    """The registered model op's forward (`op.comba_state_forward_op`): `comba_forward_reference` with a carried state,
    grouped value heads, packed sequences, either read order and q, k, p L2-normalised where asked, returning
    (o, final state (N, HV, K, V) float32, or an empty float32 tensor without output_final_state)."""
    o, final = comba_forward_reference(q, k, v, p, beta, g, scale, initial_state=initial_state,
                                       output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                                       read_order=read_order)
    return o, (final if output_final_state else final.new_empty(0))


@autocast_off
def comba_state_backward_reference(q, k, v, p, beta, g, initial_state, do, d_final, scale, cu_seqlens=None,
                                   read_order="decay_first", use_qk_l2norm=False):
    """The gradients of `comba_state_forward_reference` given do and d_final (the final state's, or None: zero):
    (dq, dk, dv, dp, dbeta, dg, d_initial_state), float32, by the analytic chunked backward with q, k and p repeated
    to the value heads and their gradients summed over each group, packed sequences unpacked to a batch (each
    zero-padded at its end, which leaves its state as it is) and their gradients packed again, and with use_qk_l2norm
    the normalisation's backward (`l2_normalised_backward`) applied to the gradients of the normalised q, k and p;
    d_initial_state is an empty float32 tensor where initial_state is None; read_order as `comba_forward_reference`
    takes it. g > 0 raises ValueError."""
    check_log_decay(g)
    check_read_order(read_order)
    if use_qk_l2norm:
        dq, dk, dv, dp, *rest = comba_state_backward_reference(
            l2_normalised(q), l2_normalised(k), v, l2_normalised(p), beta, g, initial_state, do, d_final, scale,
            cu_seqlens, read_order)
        return (l2_normalised_backward(q, dq), l2_normalised_backward(k, dk), dv, l2_normalised_backward(p, dp), *rest)
    if cu_seqlens is not None:
        bounds = sequence_bounds(cu_seqlens, q.shape[1])
        *grads, d_initial = comba_state_backward_reference(*(unpack(x, bounds) for x in (q, k, v, p, beta, g)),
                                                           initial_state, unpack(do, bounds), d_final, scale,
                                                           read_order=read_order)
        return (*(repack(x, bounds) for x in grads), d_initial)
    B, T, H, K = q.shape
    group = v.shape[2] // H
    keys = [x.repeat_interleave(group, dim=2) for x in (q, k, p)] if group > 1 else [q, k, p]
    dq, dk, dv, dp, dbeta, dg, d_initial = _chunked_backward(keys[0], keys[1], v, keys[2], beta, g, do, scale,
                                                             initial_state, d_final, read_order == "fla")
    if group > 1:
        dq, dk, dp = (x.view(B, T, H, group, K).sum(3) for x in (dq, dk, dp))
    if initial_state is None:
        d_initial = d_initial.new_empty(0)
    return dq, dk, dv, dp, dbeta, dg, d_initial
