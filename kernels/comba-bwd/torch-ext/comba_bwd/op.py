"""The registered ops (backward, forward, autograd link) and the public functions.

`comba_forward_op` runs the fused forward on CUDA tensors (`dispatch.comba_forward_cuda`) and the eager chunked
reference on CPU tensors; `comba_backward_op` runs the fused backward on CUDA tensors (`dispatch.comba_backward_cuda`)
and the eager analytic backward on CPU tensors. The autograd link saves the forward's inputs and calls
`comba_backward_op`, which makes the chunk transform and the states again. Every op name goes through
`add_op_namespace_prefix`, so two versions of this kernel can be loaded side by side.
`comba_state_forward_op` and `comba_state_backward_op` are a model's call: a carried state in and out, grouped
value heads, packed sequences, either read order and q, k and p L2-normalised where asked, the fused Triton kernels
on CUDA (`dispatch.comba_state_forward_cuda`, the normalisation and its backward Triton kernels too) and the eager
reference on the CPU. `comba_attention` takes them for such a call on CUDA. A call with K or V the kernels are not
compiled for, and every model call on the CPU run the eager reference (reference.py), differentiated by autograd.
`comba_decode` runs the registered `comba_decode` op (the fused decode kernel on CUDA, `dispatch.comba_decode_cuda`;
the recurrent reference, recurrent.py, on the CPU), the recurrent reference itself where autograd records the call,
and an eager call on plain CUDA tensors that needs neither (`common.direct_calls.calls_directly`) runs the op's entry
point directly, its argument checks skipped for a call signature that passed them before; a later call of the signature
on contiguous tensors on 16 bytes runs the direct call kept for it (`dispatch.DIRECT_DECODES`;
`common.direct_calls.launches_directly` tests what the signature cannot): its two allocations and the kept launch.

Under autocast (`common.autocast`) the ops run with autocast off: on CUDA `comba_forward` takes q, k, v, p in
autocast's dtype (the fused kernels' 16-bit operands) and beta, g as given, `comba_backward` its arguments as given;
on the CPU both take them as given and compute in float32. Reverse mode is the only differentiation of the registered
ops (`common.differentiation`): a double backward, torch.func's grad and jvp transforms and forward-mode AD raise
RuntimeError naming the public function.
"""

from typing import Optional

import torch

from ._ops import add_op_namespace_prefix
from .common.autocast import register_autocast
from .common.differentiation import check_differentiation, no_double_backward
from .common.direct_calls import CheckedSignatures, calls_directly, launches_directly
from .dispatch import (DIRECT_DECODES, comba_backward_cuda, comba_decode_cuda, comba_decode_direct, comba_forward_cuda,
                       comba_state_backward_cuda, comba_state_forward_cuda)
from .model_args import check_model_args
from .recurrent import check_decode_tokens, comba_decode_reference
from .reference import (comba_backward_reference, comba_forward_reference, comba_state_backward_reference,
                        comba_state_forward_reference, resolve_scale)
from .validation import FUSED_MODEL_V, FUSED_V, check_comba_args, fused_k

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _as_input_dtypes(grads, q, beta):
    """Gradients in their inputs' dtypes: dq, dk, dv, dp like q, dbeta like beta, dg float32 (like g)."""
    dq, dk, dv, dp, dbeta, dg = grads
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dp.to(q.dtype), dbeta.to(beta.dtype), dg.float()


@torch.library.custom_op(add_op_namespace_prefix("comba_backward"), mutates_args=(), device_types="cuda")
def comba_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    do: torch.Tensor, scale: float,
) -> Grads:
    return comba_backward_cuda(q, k, v, p, beta, g, do, scale)


@torch.library.register_kernel(add_op_namespace_prefix("comba_backward"), "cpu")
def _(q, k, v, p, beta, g, do, scale):
    return _as_input_dtypes(comba_backward_reference(q, k, v, p, beta, g, do, scale), q, beta)


@torch.library.register_fake(add_op_namespace_prefix("comba_backward"))
def _(q, k, v, p, beta, g, do, scale):
    like = (q, k, v, p, beta)
    return (*(torch.empty_like(x) for x in like), torch.empty_like(g, dtype=torch.float32))


@torch.library.custom_op(add_op_namespace_prefix("comba_forward"), mutates_args=(), device_types="cuda")
def comba_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return comba_forward_cuda(q, k, v, p, beta, g, scale)


@torch.library.register_kernel(add_op_namespace_prefix("comba_forward"), "cpu")
def _(q, k, v, p, beta, g, scale):
    return comba_forward_reference(q, k, v, p, beta, g, scale)


@torch.library.register_fake(add_op_namespace_prefix("comba_forward"))
def _(q, k, v, p, beta, g, scale):
    return torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    *tensors, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.scale = scale


def _backward(ctx, do):
    q, k, v, p, beta, g = ctx.saved_tensors
    grads = comba_backward_op(q, k, v, p, beta, g, do.contiguous(), ctx.scale)
    return (*grads, None)


torch.library.register_autograd(add_op_namespace_prefix("comba_forward"), _backward, setup_context=_setup_context)
torch.library.register_autograd(add_op_namespace_prefix("comba_backward"),
                                no_double_backward("comba_attention", "comba_backward"))
register_autocast(add_op_namespace_prefix("comba_forward"), cuda_16bit=(0, 1, 2, 3))
register_autocast(add_op_namespace_prefix("comba_backward"))


StateGrads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op(add_op_namespace_prefix("comba_state_backward"), mutates_args=(), device_types="cuda")
def comba_state_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor], do: torch.Tensor, d_final: Optional[torch.Tensor], scale: float,
    cu_seqlens: Optional[torch.Tensor] = None, read_order: str = "decay_first", use_qk_l2norm: bool = False,
) -> StateGrads:
    return comba_state_backward_cuda(q, k, v, p, beta, g, initial_state, do, d_final, scale, cu_seqlens, read_order,
                                     use_qk_l2norm)


@torch.library.register_kernel(add_op_namespace_prefix("comba_state_backward"), "cpu")
def _(q, k, v, p, beta, g, initial_state, do, d_final, scale, cu_seqlens=None, read_order="decay_first",
      use_qk_l2norm=False):
    *grads, d_initial = comba_state_backward_reference(q, k, v, p, beta, g, initial_state, do, d_final, scale,
                                                       cu_seqlens, read_order, use_qk_l2norm)
    return (*_as_input_dtypes(grads, q, beta), d_initial)


@torch.library.register_fake(add_op_namespace_prefix("comba_state_backward"))
def _(q, k, v, p, beta, g, initial_state, do, d_final, scale, cu_seqlens=None, read_order="decay_first",
      use_qk_l2norm=False):
    like = (q, k, v, p, beta)
    d_initial = v.new_empty(0, dtype=torch.float32) if initial_state is None else torch.empty_like(initial_state)
    return (*(torch.empty_like(x) for x in like), torch.empty_like(g, dtype=torch.float32), d_initial)


@torch.library.custom_op(add_op_namespace_prefix("comba_state_forward"), mutates_args=(), device_types="cuda")
def comba_state_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    initial_state: Optional[torch.Tensor], scale: float, output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor] = None, read_order: str = "decay_first", use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return comba_state_forward_cuda(q, k, v, p, beta, g, initial_state, scale, output_final_state, cu_seqlens,
                                    read_order, use_qk_l2norm)


@torch.library.register_kernel(add_op_namespace_prefix("comba_state_forward"), "cpu")
def _(q, k, v, p, beta, g, initial_state, scale, output_final_state, cu_seqlens=None, read_order="decay_first",
      use_qk_l2norm=False):
    return comba_state_forward_reference(q, k, v, p, beta, g, initial_state, scale, output_final_state, cu_seqlens,
                                         read_order, use_qk_l2norm)


@torch.library.register_fake(add_op_namespace_prefix("comba_state_forward"))
def _(q, k, v, p, beta, g, initial_state, scale, output_final_state, cu_seqlens=None, read_order="decay_first",
      use_qk_l2norm=False):
    B, _, HV, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (N, HV, q.shape[-1], V) if output_final_state else (0,)
    return torch.empty_like(v), v.new_empty(shape, dtype=torch.float32)


def _setup_state_context(ctx, inputs, output):
    *tensors, initial_state, scale, output_final_state, cu_seqlens, read_order, use_qk_l2norm = inputs
    ctx.save_for_backward(*tensors, initial_state, cu_seqlens)
    ctx.scale, ctx.output_final_state, ctx.read_order = scale, output_final_state, read_order
    ctx.use_qk_l2norm = use_qk_l2norm


def _state_backward(ctx, do, d_final):
    *tensors, initial_state, cu_seqlens = ctx.saved_tensors
    d_final = d_final.contiguous() if ctx.output_final_state and d_final is not None else None
    *grads, d_initial = comba_state_backward_op(*tensors, initial_state, do.contiguous(), d_final, ctx.scale,
                                                cu_seqlens, ctx.read_order, ctx.use_qk_l2norm)
    return (*grads, None if initial_state is None else d_initial, None, None, None, None, None)


torch.library.register_autograd(add_op_namespace_prefix("comba_state_forward"), _state_backward,
                                setup_context=_setup_state_context)
torch.library.register_autograd(add_op_namespace_prefix("comba_state_backward"),
                                no_double_backward("comba_attention", "comba_state_backward"))
register_autocast(add_op_namespace_prefix("comba_state_forward"), cuda_16bit=(0, 1, 2, 3))
register_autocast(add_op_namespace_prefix("comba_state_backward"))


# The decode step: (o, new_state), both new tensors. Not differentiable: the public function runs the recurrent
# reference where autograd records the call.
@torch.library.custom_op(add_op_namespace_prefix("comba_decode"), mutates_args=(), device_types="cuda")
def comba_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float, use_qk_l2norm: bool,
    read_order: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return comba_decode_cuda(q, k, v, p, beta, g, state, scale, cu_seqlens, use_qk_l2norm, read_order)


@torch.library.register_kernel(add_op_namespace_prefix("comba_decode"), "cpu")
def _(q, k, v, p, beta, g, state, cu_seqlens, scale, use_qk_l2norm, read_order):
    return comba_decode_reference(q, k, v, p, beta, g, state, scale, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm=use_qk_l2norm, read_order=read_order)


@torch.library.register_fake(add_op_namespace_prefix("comba_decode"))
def _(q, k, v, p, beta, g, state, cu_seqlens, scale, use_qk_l2norm, read_order):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return torch.empty_like(v), v.new_empty((N, v.shape[2], q.shape[-1], v.shape[-1]), dtype=torch.float32)


register_autocast(add_op_namespace_prefix("comba_decode"))


def _prepare(tensors, scale, K):
    return [x.contiguous() for x in tensors], (K**-0.5 if scale is None else float(scale))


def comba_backward(q, k, v, p, beta, g, do, scale=None):
    """Gradients of the Comba forward (decay before the read) with respect to q, k, v, p, beta, g.

    q, k, p: (B, T, H, K); v, do: (B, T, H, V), all bfloat16, float16 or float32 of one dtype;
    beta: (B, T, H) of any of those dtypes; g: (B, T, H) float32 log-decay, <= 0 (as in `comba_attention`).
    scale: float or None (K ** -0.5).
    Returns (dq, dk, dv, dp, dbeta, dg): dq, dk, dv, dp in q's dtype, dbeta in beta's, dg float32.
    Non-contiguous inputs are copied to contiguous ones; any T >= 1 is accepted. Under autocast the arguments are
    taken as given. Not differentiable.
    """
    check_comba_args(q, k, v, p, beta, g, scale, do)
    check_differentiation("comba_backward", q, k, v, p, beta, g, do)
    tensors, scale = _prepare((q, k, v, p, beta, g, do), scale, q.shape[-1])
    return comba_backward_op(*tensors, scale)


def _is_spec_call(q, v, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, read_order) -> bool:
    """Whether a comba_attention call is the spec's, which the registered op takes: no state in or out, no packed
    sequences, no normalisation, the spec's read order, as many value heads as query heads and, on CUDA, K and V the
    fused kernels are compiled for. Shapes and arguments only (values are never read)."""
    if (initial_state is not None or output_final_state is not False or cu_seqlens is not None
            or use_qk_l2norm is not False or read_order != "decay_first"):
        return False
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim() == 4):
        return True  # check_comba_args names the bad argument
    return q.shape[2] == v.shape[2] and (not q.is_cuda or (fused_k(q.device, q.shape[-1]) and v.shape[-1] in FUSED_V))


def _is_fused_model_call(q, v) -> bool:
    """Whether a model's comba_attention call (`_is_spec_call` false) takes the registered model op: CUDA tensors, K the
    fused kernels take on their GPU (`validation.fused_k`) and V in FUSED_MODEL_V. On the CPU the eager reference takes
    every model call itself (and normalises q, k and p in float32 whatever their dtype)."""
    return q.is_cuda and fused_k(q.device, q.shape[-1]) and v.shape[-1] in FUSED_MODEL_V


def comba_attention(q, k, v, p, beta, g, scale=None, *, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm=False, read_order="decay_first"):
    """Comba forward o (B, T, HV, V) in v's dtype, differentiable in q, k, v, p, beta, g and initial_state.

    q, k, p: (B, T, H, K); v: (B, T, HV, V) with HV a multiple of H (value head hv reads q, k, p of head
    hv // (HV / H)), bfloat16, float16 or float32 of one dtype; beta: (B, T, HV) of any of those dtypes; g: (B, T, HV)
    float32 log-decay, <= 0: g > 0 raises ValueError where values are read (the references: the CPU, and every call
    but the spec's on CUDA); the fused CUDA path reads none (a host read would synchronise the GPU), and there g > 0
    is outside the contract, its result undefined. scale: float or None (K ** -0.5).
    initial_state: (N, HV, K, V) float32 state to start from (None: zeros); N = B, or the sequences of cu_seqlens.
    output_final_state: also return the (N, HV, K, V) float32 state after the last step: (o, final_state).
    cu_seqlens: (N + 1,) int32/int64 offsets of N sequences packed along T of a batch of one (B = 1).
    use_qk_l2norm: L2-normalise q, k and p first (x / sqrt(sum(x^2) + 1e-6), as fla's use_qk_l2norm_in_kernel).
    read_order: "decay_first" (the spec's: decay, read, write) or "fla" (read, decay, write).

    The spec's call (none of the keyword arguments, H = HV, and on CUDA K in {64, 128, 256}, V in {64, 128}) runs the
    fused kernels on CUDA, forward and backward, and the eager chunked reference on the CPU. Every other call on CUDA
    with K in {64, 128, 256} and V in {64, 128, 256, 512} (a carried state, packed sequences, grouped value heads, q/k/p
    normalisation, fla's read order, V = 256 or 512) runs the fused Triton kernels too (the registered model ops), the
    normalisation and its backward included, without reading cu_seqlens on the host (no synchronisation): the
    kernels take its offsets clamped into [0, T], each raised to the largest before it
    (`common.checks.bounded_offsets`), where the references check them. Every other call runs the eager chunked
    reference (`comba_forward_reference`) on every device, its backward by autograd through it.

    The fused calls under CUDA autocast take q, k, v, p in autocast's dtype (o in that dtype); everything else
    computes in float32 under autocast. The fused calls are differentiable in reverse mode only: a double backward,
    torch.func's grad and jvp transforms and forward-mode AD raise RuntimeError.
    """
    if _is_spec_call(q, v, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, read_order):
        check_comba_args(q, k, v, p, beta, g, scale)
        check_differentiation("comba_attention", q, k, v, p, beta, g)
        tensors, scale = _prepare((q, k, v, p, beta, g), scale, q.shape[-1])
        return comba_forward_op(*tensors, scale)
    check_model_args(q, k, v, p, beta, g, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                     read_order)
    if _is_fused_model_call(q, v):
        check_differentiation("comba_attention", q, k, v, p, beta, g, initial_state)
        tensors, scale = _prepare((q, k, v, p, beta, g), scale, q.shape[-1])
        state, offsets = (None if x is None else x.contiguous() for x in (initial_state, cu_seqlens))
        o, final = comba_state_forward_op(*tensors, state, scale, output_final_state, offsets, read_order,
                                          use_qk_l2norm)
        return (o, final) if output_final_state else o
    return comba_forward_reference(q, k, v, p, beta, g, scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                   use_qk_l2norm=use_qk_l2norm, read_order=read_order)


def _differentiated(*tensors) -> bool:
    """Whether autograd records a call on these tensors: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors)


def comba_decode(q, k, v, p, beta, g, state=None, scale=None, *, cu_seqlens=None, use_qk_l2norm=False,
                 read_order="decay_first"):
    """A decode step: 1 to DECODE_MAX_TOKENS (64) new tokens per sequence after a carried state, in recurrent form.

    Arguments as `comba_attention`'s, with `state` its `initial_state` ((N, HV, K, V) float32, None: zeros).
    Returns (o (B, T, HV, V) in v's dtype, new_state (N, HV, K, V) float32), both new tensors; `state` is only read.
    On CUDA without autograd (no input requires grad, or grad mode off: inference) the fused decode kernel runs
    (`comba_decode_cuda`) at K in {64, 128, 256} and V in {64, 128, 256, 512}: no value is read on the host (the
    offsets of cu_seqlens are not checked there; T is), so the call can be captured in a CUDA graph. Every other
    call runs the recurrent reference (`comba_decode_reference`), differentiable by autograd. Under autocast the
    arguments are taken as given; under torch.func.vmap the registered op runs once a sample.
    """
    signature = _decode_signature(q, k, v, p, beta, g, state, scale, cu_seqlens, use_qk_l2norm, read_order)
    direct = False  # whether a kept direct call (`dispatch.DIRECT_DECODES`) could take the call
    if signature is not None:
        tensors = (q, k, v, p, beta, g) if state is None else (q, k, v, p, beta, g, state)
        direct = launches_directly(*tensors) if cu_seqlens is None else launches_directly(*tensors, cu_seqlens)
        if direct and (decode := DIRECT_DECODES.get(signature)) is not None:
            return decode(q, k, v, p, beta, g, state, cu_seqlens)
    if signature is None or signature not in _checked_decode:
        check_model_args(q, k, v, p, beta, g, scale, state, True, cu_seqlens, use_qk_l2norm, read_order, "state")
        if cu_seqlens is None:
            check_decode_tokens(q.shape[1])
        if signature is not None:
            _checked_decode.add(signature)
    if _differentiated(q, k, v, p, beta, g, state):
        return comba_decode_reference(q, k, v, p, beta, g, state, scale, cu_seqlens=cu_seqlens,
                                      use_qk_l2norm=use_qk_l2norm, read_order=read_order)
    # A remembered signature holds plain tensors on q's device, none recorded by autograd (above): q decides.
    if calls_directly(q) if signature is not None else calls_directly(
            q, k, v, p, beta, g, *(x for x in (state, cu_seqlens) if x is not None)):
        out = comba_decode_cuda(q, k, v, p, beta, g, state, scale, cu_seqlens, use_qk_l2norm, read_order)
        if direct:
            DIRECT_DECODES.keep(signature, comba_decode_direct(q, k, v, p, beta, g, state, scale, cu_seqlens,
                                                               use_qk_l2norm, read_order))
        return out
    return comba_decode_op(q, k, v, p, beta, g, state, cu_seqlens, resolve_scale(scale, q.shape[-1]), use_qk_l2norm,
                           read_order)


# Call signatures of `comba_decode` that passed its argument checks (`check_model_args`, and the token count without
# cu_seqlens): the checks cost several times the lookup, a share of a decode step's launch-bound budget worth saving.
_checked_decode = CheckedSignatures()


def _decode_signature(q, k, v, p, beta, g, state, scale, cu_seqlens, use_qk_l2norm, read_order) -> tuple | None:
    """What the checks of `comba_decode` read of a call of plain tensors, a Python float, int or None scale, a bool
    use_qk_l2norm and a str read_order (None, checked every call, for every other call): the shapes, dtypes and
    devices, and the scalars."""
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or type(p) is not torch.Tensor or type(beta) is not torch.Tensor or type(g) is not torch.Tensor
            or not (state is None or type(state) is torch.Tensor)
            or not (cu_seqlens is None or type(cu_seqlens) is torch.Tensor)
            or not (scale is None or type(scale) in (float, int)) or type(use_qk_l2norm) is not bool
            or type(read_order) is not str):
        return None
    state_of = None if state is None else (state.shape, state.dtype, state.device)
    offsets_of = None if cu_seqlens is None else (cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device)
    return (q.shape, k.shape, v.shape, p.shape, beta.shape, g.shape, q.dtype, k.dtype, v.dtype, p.dtype, beta.dtype,
            g.dtype, q.device, k.device, v.device, p.device, beta.device, g.device, scale, use_qk_l2norm, read_order,
            state_of, offsets_of)
