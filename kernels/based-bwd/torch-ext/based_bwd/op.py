"""The registered ops (backward, forward with its autograd link) and the public functions.

`based_attention` with a state or packed sequences goes through a second pair of ops, `based_state_forward` and
`based_state_backward` (fused on CUDA for bf16 and fp16), so that the plain (q, k, v) ops stay as they are.
`based_decode` runs the registered `based_decode` op (the fused decode kernel on CUDA, the reference on the CPU), the
reference where autograd records the call, and an eager call on plain CUDA tensors that needs neither
(`common.direct_calls.calls_directly`) runs the op's entry point `dispatch.based_decode_cuda` directly, its argument
checks skipped for a call signature that passed them before; a later call of the signature on contiguous tensors on 16
bytes runs the direct call kept for it (`dispatch.DIRECT_DECODES`; `common.direct_calls.launches_directly` tests what
the signature cannot, and `out`'s memory is checked every call): its allocations and the kept launch.

The CUDA implementations come from `dispatch`, which picks each call's path. `based_forward`'s registered autograd calls
the registered `based_backward` op, so training goes through the same backward as a direct call, and inference
under no_grad through the same forward. Every op name goes through `add_op_namespace_prefix`, so two versions of
this kernel can be loaded side by side.

Under autocast (`common.autocast`) the ops run with autocast off: on CUDA the two forwards take q, k, v in autocast's
dtype (the fused kernels' 16-bit operands), the two backwards their arguments as given; on the CPU every op takes
them as given and computes in float32. Reverse mode is the only differentiation (`common.differentiation`): a
double backward, torch.func's grad and jvp transforms and forward-mode AD raise RuntimeError naming the public
function.
"""

import torch

from ._ops import add_op_namespace_prefix
from .common.autocast import register_autocast
from .common.differentiation import check_differentiation, no_double_backward
from .common.direct_calls import CheckedSignatures, calls_directly, launches_directly
from .dispatch import (
    DIRECT_DECODES,
    based_backward_cuda,
    based_decode_cuda,
    based_decode_direct,
    based_forward_cuda,
    based_state_backward_cuda,
    based_state_forward_cuda,
)
from .reference import (
    MAX_DECODE_TOKENS,
    based_backward_reference,
    based_decode_reference,
    based_forward_reference,
    based_state_backward_reference,
    default_scale,
)
from .validation import check_based_args, check_decode_args, check_decode_memory, check_state_args


@torch.library.custom_op(add_op_namespace_prefix("based_backward"), mutates_args=(), device_types="cuda")
def based_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return based_backward_cuda(q, k, v, do, scale)


@torch.library.register_kernel(add_op_namespace_prefix("based_backward"), "cpu")
def _(q, k, v, do, scale):
    return based_backward_reference(q, k, v, do, scale)


@torch.library.register_fake(add_op_namespace_prefix("based_backward"))
def _(q, k, v, do, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op(add_op_namespace_prefix("based_forward"), mutates_args=(), device_types="cuda")
def based_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return based_forward_cuda(q, k, v, scale)


@torch.library.register_kernel(add_op_namespace_prefix("based_forward"), "cpu")
def _(q, k, v, scale):
    return based_forward_reference(q, k, v, scale)


@torch.library.register_fake(add_op_namespace_prefix("based_forward"))
def _(q, k, v, scale):
    return torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scale = scale


def _backward(ctx, grad_out):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = based_backward_op(q, k, v, grad_out.to(q.dtype).contiguous(), ctx.scale)
    return dq, dk, dv, None


torch.library.register_autograd(add_op_namespace_prefix("based_forward"), _backward, setup_context=_setup_context)
torch.library.register_autograd(add_op_namespace_prefix("based_backward"),
                                no_double_backward("based_attention", "based_backward"))
register_autocast(add_op_namespace_prefix("based_forward"), cuda_16bit=(0, 1, 2))
register_autocast(add_op_namespace_prefix("based_backward"))


# The stateful forward: from an initial state (S0, z0) or zero (None), over packed sequences (cu_seqlens) or
# the batch, with the final state (S, z) when output_final_state (else S and z are empty); a separate op, so that
# the plain (q, k, v) op stays as it is. Its backward takes dS and dz empty where there is no final state, and
# returns dS0 and dz0 empty where there is no initial state, so that the kernels skip what nobody reads.
@torch.library.custom_op(add_op_namespace_prefix("based_state_backward"), mutates_args=(), device_types="cuda")
def based_state_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, dS: torch.Tensor, dz: torch.Tensor,
    S0: torch.Tensor | None, z0: torch.Tensor | None, cu_seqlens: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return based_state_backward_cuda(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale)


@torch.library.register_kernel(add_op_namespace_prefix("based_state_backward"), "cpu")
def _(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale):
    return based_state_backward_reference(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale)


@torch.library.register_fake(add_op_namespace_prefix("based_state_backward"))
def _(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale):
    if S0 is None:
        d_initial = (q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32))
    else:
        d_initial = (torch.empty_like(S0), torch.empty_like(z0))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *d_initial


@torch.library.custom_op(add_op_namespace_prefix("based_state_forward"), mutates_args=(), device_types="cuda")
def based_state_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor | None, z0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, scale: float, output_final_state: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return based_state_forward_cuda(q, k, v, S0, z0, cu_seqlens, scale, output_final_state)


@torch.library.register_kernel(add_op_namespace_prefix("based_state_forward"), "cpu")
def _(q, k, v, S0, z0, cu_seqlens, scale, output_final_state):
    o, (S, z) = based_forward_reference(q, k, v, scale, initial_state=None if S0 is None else (S0, z0),
                                        output_final_state=True, cu_seqlens=cu_seqlens)
    return (o, S, z) if output_final_state else (o, S.new_empty(0), z.new_empty(0))


@torch.library.register_fake(add_op_namespace_prefix("based_state_forward"))
def _(q, k, v, S0, z0, cu_seqlens, scale, output_final_state):
    if not output_final_state:
        return torch.empty_like(v), q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    H, K = q.shape[2:]
    P = 1 + K + K * K
    S = q.new_empty(N, H, P, v.shape[-1], dtype=torch.float32)
    return torch.empty_like(v), S, q.new_empty(N, H, P, dtype=torch.float32)


def _state_setup_context(ctx, inputs, output):
    q, k, v, S0, z0, cu_seqlens, scale, _ = inputs
    ctx.save_for_backward(q, k, v, S0, z0, cu_seqlens)
    ctx.scale = scale


def _state_backward(ctx, do, dS, dz):
    q, k, v, S0, z0, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dS0, dz0 = based_state_backward_op(q, k, v, do.to(q.dtype).contiguous(), dS.contiguous(),
                                                   dz.contiguous(), S0, z0, cu_seqlens, ctx.scale)
    if S0 is None:
        dS0 = dz0 = None
    return dq, dk, dv, dS0, dz0, None, None, None


torch.library.register_autograd(add_op_namespace_prefix("based_state_forward"), _state_backward,
                                setup_context=_state_setup_context)
torch.library.register_autograd(add_op_namespace_prefix("based_state_backward"),
                                no_double_backward("based_attention", "based_state_backward"))
register_autocast(add_op_namespace_prefix("based_state_forward"), cuda_16bit=(0, 1, 2))
register_autocast(add_op_namespace_prefix("based_state_backward"))


# The decode step: the new state written to S_out, z_out (new tensors or the caller's `out`), o returned. Not
# differentiable: the public function runs the reference where autograd records the call.
@torch.library.custom_op(add_op_namespace_prefix("based_decode"), mutates_args=("S_out", "z_out"), device_types="cuda")
def based_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor, scale: float,
                    S_out: torch.Tensor, z_out: torch.Tensor) -> torch.Tensor:
    return based_decode_cuda(q, k, v, S, z, scale, S_out, z_out)


@torch.library.register_kernel(add_op_namespace_prefix("based_decode"), "cpu")
def _(q, k, v, S, z, scale, S_out, z_out):
    o, (S_new, z_new) = based_decode_reference(q, k, v, (S, z), scale)
    S_out.copy_(S_new)
    z_out.copy_(z_new)
    return o


@torch.library.register_fake(add_op_namespace_prefix("based_decode"))
def _(q, k, v, S, z, scale, S_out, z_out):
    return torch.empty_like(v)


register_autocast(add_op_namespace_prefix("based_decode"))


def _resolved(q, scale) -> float:
    return default_scale(q.shape[-1]) if scale is None else float(scale)


def based_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, scale=None):
    """Gradients (dq, dk, dv) of the causal Based attention o = based_attention(q, k, v, scale) for the
    incoming gradient do.

    q, k: (B, T, H, K); v, do: (B, T, H, V); one dtype among float32/bfloat16/float16, one device. K is the
    Taylor feature size: 8 or 16 on CUDA, any on CPU. scale multiplies q only; None means K ** -0.5.
    Returns dq, dk, dv with the shapes and dtype of q, k, v. Non-contiguous inputs are copied. Under autocast the
    arguments are taken as given. Not differentiable.
    """
    check_based_args(q, k, v, scale, do=do)
    check_differentiation("based_backward", q, k, v, do)
    return based_backward_op(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), _resolved(q, scale))


def based_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale=None,
    *,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
):
    """Causal Based (2nd-order Taylor) attention o (B, T, H, V) in q's dtype, differentiable in q, k, v:

    o_i = sum_{j<=i} A_ij v_j / (sum_{j<=i} A_ij + 1e-6),  A_ij = 1 + s_ij + s_ij^2 / 2,  s_ij = scale q_i . k_j.

    Same q, k, v and scale as `based_backward`. Without the keyword arguments it is the registered forward, whose
    gradients come from the registered `based_backward` op (fused on CUDA); under CUDA autocast it takes q, k, v in
    autocast's dtype (o in that dtype), under CPU autocast as given. Reverse mode only: a double backward, torch.func's
    grad and jvp transforms and forward-mode AD raise RuntimeError.

    With a state (over phi(x) = [1, x, x (x) x / sqrt(2)], P = 1 + K + K^2 features; the sums above then start
    from it, `reference.py` states the formula) or packed sequences:

    - initial_state: the pair (S (N, H, P, V), z (N, H, P)), float32, S = sum_j phi(k_j) v_j^T and
      z = sum_j phi(k_j) over the steps before; differentiable. N = B, or the number of packed sequences.
    - output_final_state: also return the state after the last step, as (o, (S, z)), float32.
    - cu_seqlens: the N + 1 offsets (int32/int64, 0 to T, non-decreasing) of N sequences packed along T with
      B = 1; no sum crosses two of them. Its values are checked on CPU tensors; on a GPU they are not read on the
      host (no device sync): offsets outside [0, T] are clamped into it and a decreasing one raised to the one
      before it.

    With a state or packed sequences the call goes through the registered `based_state_forward` and
    `based_state_backward`: bf16 and fp16 CUDA tensors take the fused kernels (V <= 256 backward, wider V the
    reference), fp32 and CPU tensors the eager reference and its analytic backward in fp32, autocast or not.
    """
    check_based_args(q, k, v, scale)
    if initial_state is None and output_final_state is False and cu_seqlens is None:
        check_differentiation("based_attention", q, k, v)
        return based_forward_op(q.contiguous(), k.contiguous(), v.contiguous(), _resolved(q, scale))
    check_state_args(q, v, initial_state, output_final_state, cu_seqlens)
    check_differentiation("based_attention", q, k, v, *(initial_state or ()))
    S0, z0 = (None, None) if initial_state is None else (x.contiguous() for x in initial_state)
    o, S, z = based_state_forward_op(q.contiguous(), k.contiguous(), v.contiguous(), S0, z0, cu_seqlens,
                                     _resolved(q, scale), output_final_state)
    return (o, (S, z)) if output_final_state else o


def based_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state, scale=None, *, out=None):
    """T new steps (1 <= T <= 64) of B sequences from their state, in recurrent form: returns o (B, T, H, V) in
    q's dtype and the new state (S, z), float32. The given state is not modified: the new one is in new tensors,
    or in `out`.

    q, k: (B, T, H, K); v: (B, T, H, V); state: the pair (S (B, H, P, V), z (B, H, P)), float32, as
    `based_attention(..., output_final_state=True)` returns it (P = 1 + K + K^2). The steps equal those of
    `based_attention` on the same sequences. out: None, or a pair of contiguous float32 tensors shaped like the
    state that shares no memory with it; the new state is written there and `out` is returned as the new state
    (a serving loop alternates two state buffers, one CUDA graph each way, and copies nothing).

    On CUDA one fused kernel launch (every dtype; the reference where autograd records the call or a torch.func
    transform sees it), on the CPU the eager reference; neither reads a tensor on the host or allocates by value, so
    a CUDA graph can capture the call. Differentiable through torch autograd (the reference). Under autocast the
    arguments are taken as given.
    """
    signature = _decode_signature(q, k, v, state, scale, out)
    direct = False  # whether a kept direct call (`dispatch.DIRECT_DECODES`) could take the call
    if signature is not None:
        S, z = state
        direct = launches_directly(q, k, v, S, z) if out is None else launches_directly(q, k, v, S, z, *out)
        if direct and (decode := DIRECT_DECODES.get(signature)) is not None:
            if out is not None:
                check_decode_memory(state, out)
            return decode(q, k, v, S, z, out)
    if signature is None or signature not in _checked_decode:
        check_decode_args(q, k, v, state, scale, MAX_DECODE_TOKENS, out)
        if signature is not None:
            _checked_decode.add(signature)
    S, z = state
    if out is not None:
        check_decode_memory(state, out)
    scale = _resolved(q, scale)
    # The reference (torch ops) where autograd records the call or a torch.func transform (vmap, grad) sees it.
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or S.requires_grad
                                     or z.requires_grad)) or torch._C._are_functorch_transforms_active():
        o, new = based_decode_reference(q, k, v, (S, z), scale)
        if out is None:
            return o, new
        return o, _written(new, out)
    contiguous = torch.contiguous_format  # the kernel writes the new state row-major, whatever the state's layout
    S_out, z_out = (torch.empty_like(S, memory_format=contiguous), torch.empty_like(z, memory_format=contiguous)
                    ) if out is None else out
    # A remembered signature holds plain tensors on q's device, none recorded by autograd (above): q decides.
    if calls_directly(q) if signature is not None else calls_directly(q, k, v, S, z, S_out, z_out):
        o = based_decode_cuda(q, k, v, S, z, scale, S_out, z_out)
        if direct:
            DIRECT_DECODES.keep(signature, based_decode_direct(q, k, v, S, z, scale))
    else:
        o = based_decode_op(q, k, v, S, z, scale, S_out, z_out)
    return o, (S_out, z_out)


def _written(state, out) -> tuple:
    """`out` holding `state`: each tensor copied into its buffer (differentiably)."""
    for buffer, x in zip(out, state):
        buffer.copy_(x)
    return tuple(out)


# Call signatures of `based_decode` that passed check_decode_args: the checks cost several times the lookup, a share
# of a decode step's launch-bound budget worth saving.
_checked_decode = CheckedSignatures()


def _decode_signature(q, k, v, state, scale, out) -> tuple | None:
    """What `check_decode_args` reads of a call of plain tensors, the state and out as tuples or lists and a Python
    float, int or None scale (None, checked every call, for every other call): the shapes, dtypes and devices, out's
    strides, and the scale."""
    if (type(state) not in (tuple, list) or len(state) != 2 or not (scale is None or type(scale) in (float, int))
            or not (out is None or (type(out) in (tuple, list) and len(out) == 2))):
        return None
    S, z = state
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or type(S) is not torch.Tensor or type(z) is not torch.Tensor):
        return None
    signature = (q.shape, k.shape, v.shape, S.shape, z.shape, q.dtype, k.dtype, v.dtype, S.dtype, z.dtype, q.device,
                 k.device, v.device, S.device, z.device, scale)
    if out is None:
        return signature
    S_out, z_out = out
    if type(S_out) is not torch.Tensor or type(z_out) is not torch.Tensor:
        return None
    return (*signature, S_out.shape, z_out.shape, S_out.stride(), z_out.stride(), S_out.dtype, z_out.dtype,
            S_out.device, z_out.device)
