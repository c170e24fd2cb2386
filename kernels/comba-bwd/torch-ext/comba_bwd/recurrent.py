"""The recurrent (token-by-token) Comba reference: the decode step's specification, and its path on the CPU, under
autograd and at the sizes the fused decode kernel (portable/decode.py) does not take.

The same function as `reference.comba_forward_reference` with the same keyword arguments (its docstring), one step
at a time in float32: no chunk transform, so it suits the few new tokens of a decode step after a carried state.
The rules on values are the chunked reference's: g > 0 raises ValueError; a non-finite input at step t of a sequence
and value head makes its outputs from t on and its final state NaN, and changes nothing else.
"""

import torch

from .common.autocast import autocast_off
from .reference import (
    Sequences,
    check_log_decay,
    check_read_order,
    initial_states,
    resolve_scale,
    sequence_bounds,
)

# The most new tokens per sequence a decode call takes (`comba_decode`).
DECODE_MAX_TOKENS = 64


@autocast_off
def comba_recurrent_reference(q, k, v, p, beta, g, scale=None, *, initial_state=None, cu_seqlens=None,
                              use_qk_l2norm=False, read_order="decay_first"):
    """Comba, one token at a time in float32, differentiable by autograd: (o (B, T, HV, V) in v's dtype, final state
    (N, HV, K, V) float32). Arguments as `comba_forward_reference`'s."""
    check_log_decay(g)
    check_read_order(read_order)
    K, V, HV = q.shape[-1], v.shape[-1], v.shape[2]
    x = Sequences(q, k, v, p, beta, g, cu_seqlens, use_qk_l2norm, multiple=1)
    S = initial_states(initial_state, x.q.shape[0], HV, K, V, q.device)
    scale = resolve_scale(scale, K)
    read_first = read_order == "fla"
    out = []
    for t in range(x.q.shape[1]):
        decay = x.g[:, t, :, None, None].exp()
        if not read_first:
            S = decay * S
        u = x.beta[:, t, :, None] * (x.v[:, t] - torch.einsum("nhkv,nhk->nhv", S, x.p[:, t]))
        if read_first:
            S = decay * S
        S = S + x.k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("nhkv,nhk->nhv", S, scale * x.q[:, t]))
    o, final = x.outputs(torch.stack(out, 1), S)
    return o.to(v.dtype), final


def check_decode_tokens(T: int, cu_seqlens=None) -> None:
    """ValueError if a sequence of a decode call has more than DECODE_MAX_TOKENS tokens: T, or with cu_seqlens the
    packed lengths (reads the offsets, `sequence_bounds`)."""
    lengths = [T] if cu_seqlens is None else [b - a for a, b in sequence_bounds(cu_seqlens, T)]
    if max(lengths) > DECODE_MAX_TOKENS:
        raise ValueError(f"comba_decode takes 1 to {DECODE_MAX_TOKENS} new tokens per sequence, got a sequence of "
                         f"{max(lengths)} (comba_attention takes any length)")


def comba_decode_reference(q, k, v, p, beta, g, state=None, scale=None, *, cu_seqlens=None, use_qk_l2norm=False,
                           read_order="decay_first"):
    """`comba_decode` on the recurrent reference: the lengths checked (the offsets read), then
    `comba_recurrent_reference` from `state`: (o, new_state), differentiable by autograd."""
    check_decode_tokens(q.shape[1], cu_seqlens)
    return comba_recurrent_reference(q, k, v, p, beta, g, scale, initial_state=state, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm=use_qk_l2norm, read_order=read_order)
