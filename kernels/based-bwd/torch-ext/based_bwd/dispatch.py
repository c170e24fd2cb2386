"""Each call's path and plan, in one place: bf16 and fp16 CUDA tensors take the portable Triton kernels
(`portable/`), fp32 tensors and the CPU the eager reference, and a backward with a value size V above its
kernels' bound the reference as well. The decode step takes its fused kernel (`portable.decode`) for every dtype
on CUDA (`based_decode_cuda`; the public function runs the reference where autograd records the call);
`based_decode_direct` is what it does for a call signature, kept by the public function (`DIRECT_DECODES`). The package
has no Hopper-only fast paths.

The portable forward is two stages (`states`: the forward scan, then `output`), the backward four (the forward
scan, `grads`' dq, the reverse scan, `grads`' dk and dv); `portable_forward` and `portable_backward` launch
them in order, with the launch plans of `forward_config` and `backward_config`. fp16 inputs run
the bf16 kernels, converted in and out.

`portable_state_forward` and `portable_state_backward` launch the same stages with an initial state, a final state
and packed sequences (the entry points of the registered `based_state_forward` / `based_state_backward`); they
fold the public state's rows into the kernels' packed rows and back.
"""

import functools
from typing import NamedTuple

import torch

from .common.devices import gpu, on_device
from .common.direct_calls import DirectCalls, stage_module
from .common.fast_paths import TRITON_RELEASE
from .reference import based_backward_reference, based_forward_reference, based_state_backward_reference


class BackwardConfig(NamedTuple):
    """The backward's launch plan: the chunk C, the chunk kernels' warps and the registers a thread of theirs
    may use (ptxas' maxnreg; None: as many as it wants); the scans' feature rows and V columns per program, their
    warps and software-pipeline stages (Triton's num_stages: the next chunk's loads issued while this one's
    product runs); and on packed sequences the scans' segments of at most scan_segment_chunks chunks (None: each
    sequence scanned whole; `portable.states.Packing`)."""

    chunk: int = 64
    warps: int = 4
    chunk_registers: int | None = 168  # three 4-warp CTAs an SM
    scan_rows: int = 64
    scan_bv: int = 64
    scan_warps: int = 8
    scan_segment_chunks: int | None = None
    scan_stages: int = 1


class ForwardConfig(NamedTuple):
    """The forward's launch plan: the chunk C; the output kernel's V columns a program and warps; the scan's
    feature rows and V columns a program, warps and software-pipeline stages (as `BackwardConfig`'s), and on packed
    sequences its segments of at most scan_segment_chunks chunks (None: each sequence scanned whole;
    `portable.states.Packing`)."""

    chunk: int = 64
    bv: int = 128
    warps: int = 4
    scan_rows: int = 64
    scan_bv: int = 64
    scan_warps: int = 8
    scan_segment_chunks: int | None = None
    scan_stages: int = 1


class DecodeConfig(NamedTuple):
    """The decode step's launch plan: the V columns of S a program owns (all P rows of them, in registers across
    the tokens) and its warps."""

    bv: int = 32
    warps: int = 4


# The launches the public ops use, per feature size K, and the alternatives the benchmark times beside them;
# the benchmark's timings choose among them. Backward: the chunk kernels on 4 warps capped at 168 registers a
# thread (three CTAs an SM instead of two uncapped). Forward: at K = 8 the whole of V = 128 fits three 4-warp
# CTAs an SM. At K = 16 the scans take 32 feature rows and 128 V columns a program, two stages (the scan waits
# on its loads: the next chunk's are issued before this one's product), and the forward takes chunks of 128
# (half the states to write and read back), its output kernel 128 columns on 8 warps. The chunk kernels and
# the K = 8 scans run num_stages=1.
_SCANS_K16 = dict(scan_rows=32, scan_bv=128, scan_stages=2)
DEFAULT_BACKWARD_CONFIG = {8: BackwardConfig(), 16: BackwardConfig(**_SCANS_K16)}
BACKWARD_CONFIG_CHOICES = [BackwardConfig(), BackwardConfig(chunk_registers=None),
                           BackwardConfig(warps=8, chunk_registers=None)]
DEFAULT_FORWARD_CONFIG = {8: ForwardConfig(), 16: ForwardConfig(chunk=128, warps=8, **_SCANS_K16)}
FORWARD_CONFIG_CHOICES = [ForwardConfig(), ForwardConfig(bv=64), ForwardConfig(warps=8),
                          ForwardConfig(bv=64, warps=8), ForwardConfig(bv=64, **_SCANS_K16),
                          ForwardConfig(chunk=128, bv=64, warps=8, **_SCANS_K16)]
# The plans at K = TUNED_K above are measured under Triton 3.6 (TUNED_TRITONS): under 3.9 their pipelined scans run
# slower than the unpipelined ones, and under 3.8 and 3.9 the chunk-128 output kernel spills.
# That kernel also holds 168 KB of shared memory a CTA (CHUNK_128_SHARED), more than sm_80 (163 KB) and sm_86, sm_89
# and sm_120 (99 KB) give one. Under the other Tritons both directions run the UNTUNED plans at TUNED_K, and so does
# the forward on GPUs short of that shared memory (`forward_config`, `backward_config`).
TUNED_K = 16
TUNED_TRITONS = ("3.6",)
CHUNK_128_SHARED = 168 * 1024
UNTUNED_FORWARD_CONFIG = ForwardConfig(bv=64)
UNTUNED_BACKWARD_CONFIG = BackwardConfig()
# The decode step: 32 columns a program on 4 warps (N H V / 32 programs; at K = 16 a program holds 273 x 32 fp32
# of state, 128 registers a thread in the sm_90a compile, four CTAs an SM); the benchmark times the others beside
# it.
DEFAULT_DECODE_CONFIG = DecodeConfig()
DECODE_CONFIG_CHOICES = [DecodeConfig(bv=16), DecodeConfig(bv=64, warps=8), DecodeConfig(warps=8),
                         DecodeConfig(bv=16, warps=2)]


def forward_config(K: int, device: torch.device) -> ForwardConfig:
    """The forward's plan at feature size K on `device` (meta tensors: the GPU they stand for,
    `devices.meta_gpu`): DEFAULT_FORWARD_CONFIG[K], or at TUNED_K UNTUNED_FORWARD_CONFIG under a Triton release not in
    TUNED_TRITONS or on a GPU whose CTAs may not use CHUNK_128_SHARED bytes of shared memory."""
    if K == TUNED_K and (TRITON_RELEASE not in TUNED_TRITONS or (
            device.type in ("cuda", "meta") and gpu(device).shared_per_cta < CHUNK_128_SHARED)):
        return UNTUNED_FORWARD_CONFIG
    return DEFAULT_FORWARD_CONFIG[K]


def backward_config(K: int) -> BackwardConfig:
    """The backward's plan at feature size K: DEFAULT_BACKWARD_CONFIG[K], or at TUNED_K UNTUNED_BACKWARD_CONFIG under
    a Triton release not in TUNED_TRITONS."""
    if K == TUNED_K and TRITON_RELEASE not in TUNED_TRITONS:
        return UNTUNED_BACKWARD_CONFIG
    return DEFAULT_BACKWARD_CONFIG[K]


def kernel_path(x: torch.Tensor) -> str:
    """Which implementation a call on `x` takes by device and dtype: "triton" for bf16/fp16 CUDA tensors,
    "reference" otherwise. A backward with a value size V above portable.grads.MAX_V takes the reference
    whatever this names (`based_backward_cuda`); the decode step takes its kernel on fp32 CUDA tensors too
    (`based_decode_cuda`)."""
    # The backward's fp32 mode (IEEE fp32 matmuls) fails its float64 check at K=8 on the H200, and the
    # forward's spills, so fp32 inputs take the eager reference on CUDA too.
    return "triton" if x.is_cuda and x.dtype != torch.float32 else "reference"


def based_backward_cuda(q, k, v, do, scale: float):
    """(dq, dk, dv) on the path `kernel_path` names for CUDA tensors."""
    if kernel_path(q) == "reference":
        return based_backward_reference(q, k, v, do, scale)
    from .portable.grads import MAX_V  # triton is imported only on the CUDA path

    if v.shape[-1] > MAX_V:
        return based_backward_reference(q, k, v, do, scale)
    return portable_backward(q, k, v, do, scale)


def based_forward_cuda(q, k, v, scale: float):
    """o on the path `kernel_path` names for CUDA tensors (the portable forward takes any V)."""
    if kernel_path(q) == "reference":
        return based_forward_reference(q, k, v, scale)
    return portable_forward(q, k, v, scale)


def based_decode_cuda(q, k, v, S, z, scale: float, S_out, z_out, config: DecodeConfig | None = None):
    """o (B, T, H, V) in v's dtype of the decode step on CUDA tensors (or CPU tensors, in the Triton interpreter), the
    new state written to S_out, z_out: one launch of the fused kernel (`portable.decode`), on every dtype, for
    (B, T, H, K) q, k and (B, T, H, V) v with K in {8, 16}, 1 <= T <= 64, any V, and the state (S (B, H, P, V),
    z (B, H, P)) float32, which is left as it is; S_out, z_out: contiguous tensors like the state's sharing no
    memory with it. No tensor is read on the host and nothing is allocated by value, so a CUDA graph can capture
    the call. `config` overrides DEFAULT_DECODE_CONFIG. The registered op's entry point, and the public function's
    direct call (checked by it); the decode kernel has no backward: autograd records the reference instead."""
    cfg = config or DEFAULT_DECODE_CONFIG
    q, k, v, S, z = q.contiguous(), k.contiguous(), v.contiguous(), S.contiguous(), z.contiguous()
    o = torch.empty_like(v)
    with on_device(q):
        stage_module(__package__, "portable.decode").launch(q, k, v, S, z, o, S_out, z_out, scale, bv=cfg.bv,
                                                             warps=cfg.warps)
    return o


# The kept direct calls of `based_decode` (`based_decode_direct`) by its call signature: see
# `common.direct_calls.DirectCalls`. They hold the plan of DEFAULT_DECODE_CONFIG.
DIRECT_DECODES = DirectCalls()


def based_decode_direct(q, k, v, S, z, scale: float):
    """What the public function's direct call does (`based_decode_cuda` into new tensors, or into `out`), once it ran
    on tensors on 16 bytes, for every call of the same shapes, dtypes, device and scale on contiguous tensors on 16
    bytes (`common.direct_calls.launches_directly`): a function (q, k, v, S, z, out) -> (o, (S_out, z_out)) that
    allocates o, and the new state where out is None, and launches the kept kernel. None where no launcher is kept
    (the interpreter, no call on 16 bytes yet). Whether `out` shares memory with the state is the caller's check."""
    cfg = DEFAULT_DECODE_CONFIG
    launch_kept = stage_module(__package__, "portable.decode").kept_launch(q, k, v, S, z, scale, bv=cfg.bv,
                                                                           warps=cfg.warps)
    if launch_kept is None:
        return None
    empty_like, contiguous = torch.empty_like, torch.contiguous_format

    def based_decode_kept(q, k, v, S, z, out):
        o = empty_like(v)
        S_out, z_out = (empty_like(S, memory_format=contiguous), empty_like(z, memory_format=contiguous)
                        ) if out is None else out
        launch_kept(q, k, v, S, z, o, S_out, z_out)
        return o, (S_out, z_out)

    return based_decode_kept


def portable_decode(q, k, v, state, scale: float, config: DecodeConfig | None = None, out=None):
    """(o, (S, z)) of `based_decode_cuda` on the launch plan `config` (the tests' and the benchmark's call), the new
    state in new tensors, or in `out` (returned as the new state)."""
    S_out, z_out = (torch.empty_like(state[0]), torch.empty_like(state[1])) if out is None else out
    return based_decode_cuda(q, k, v, *state, scale, S_out, z_out, config), (S_out, z_out)


def portable_backward(q, k, v, do, scale: float, config: BackwardConfig | None = None):
    """(dq, dk, dv) from the portable kernels for contiguous (B, T, H, K) q, k and (B, T, H, V) v, do with K in
    {8, 16}, any T >= 1, 1 <= V <= portable.grads.MAX_V; outputs in the inputs' dtype. `config` overrides
    `backward_config`'s plan. CPU tensors run the kernels in the Triton interpreter."""
    from .portable import grads, states  # triton is imported only where the kernels run

    if q.dtype == torch.float16:
        # Run as bf16, which the matmul operands are in either way: launched on fp16 tensors the kernels give
        # a wrong dq on the H200, where bf16 is right.
        got = portable_backward(*(x.to(torch.bfloat16) for x in (q, k, v, do)), scale, config)
        return tuple(x.to(torch.float16) for x in got)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if V > grads.MAX_V:
        raise ValueError(f"the fused backward holds V whole in a program: V <= {grads.MAX_V}, got V={V}")
    cfg = config or backward_config(K)
    S, Z = states.state_buffers(q, V, cfg.chunk)
    h = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    g = torch.empty_like(do)  # r do, rounded to the matmul operand type (the inputs')
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scan = dict(chunk=cfg.chunk, rows=cfg.scan_rows, bv=cfg.scan_bv, warps=cfg.scan_warps, stages=cfg.scan_stages)
    chunk = dict(chunk=cfg.chunk, warps=cfg.warps, registers=cfg.chunk_registers)
    with on_device(q):
        states.launch(k, v, h, S, Z, scale, reverse=False, **scan)  # h is not read (unweighted)
        grads.launch_dq(q, k, v, do, S, Z, h, g, dq, scale, **chunk)
        states.launch(q, g, h, S, Z, scale, reverse=True, **scan)  # overwrites S_n with dS_n
        grads.launch_dkdv(q, k, v, g, S, Z, h, dk, dv, scale, **chunk)
    return dq, dk, dv


def portable_forward(q, k, v, scale: float, config: ForwardConfig | None = None) -> torch.Tensor:
    """o (B, T, H, V) from the portable kernels, in the inputs' dtype, for contiguous (B, T, H, K) q, k and
    (B, T, H, V) v with K in {8, 16}, any T, V >= 1. `config` overrides `forward_config`'s plan. CPU tensors
    run the kernels in the Triton interpreter."""
    from .portable import output, states  # triton is imported only where the kernels run

    if q.dtype == torch.float16:
        # the states outgrow fp16's range over long sequences
        return portable_forward(*(x.to(torch.bfloat16) for x in (q, k, v)), scale, config).to(torch.float16)
    cfg = config or forward_config(q.shape[-1], q.device)
    S, Z = states.state_buffers(q, v.shape[-1], cfg.chunk)
    o = torch.empty_like(v)
    with on_device(q):
        # the scan's weights are not read forward (unweighted)
        states.launch(k, v, Z, S, Z, scale, chunk=cfg.chunk, reverse=False, rows=cfg.scan_rows, bv=cfg.scan_bv,
                      warps=cfg.scan_warps, stages=cfg.scan_stages)
        output.launch(q, k, v, S, Z, o, scale, chunk=cfg.chunk, bv=cfg.bv, warps=cfg.warps)
    return o


# ---- a state in and out, packed sequences


@functools.cache
def _pairs(K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quadratic features' two layouts: the kernels' packed rows, one per pair a <= b row by row
    (`portable.states`), and the public state's K^2 ordered pairs at a K + b. Returns, per packed row, the
    ordered indices of (a, b) and of (b, a), and per ordered pair its packed row (all int64, on `device`)."""
    a, b = torch.triu_indices(K, K, device=device)
    packed = torch.empty(K, K, dtype=torch.int64, device=device)
    packed[a, b] = torch.arange(a.numel(), device=device)
    packed[b, a] = torch.arange(a.numel(), device=device)
    return a * K + b, b * K + a, packed.flatten()


def _fold(x: torch.Tensor, dim: int, K: int, coef: float) -> torch.Tensor:
    """The packed rows of a public-layout state x (1 + K + K^2 along dim): the constant and linear rows as they
    are, a pair's row coef (x[ab] + x[ba])."""
    ab, ba, _ = _pairs(K, x.device)
    quad = x.narrow(dim, 1 + K, K * K)
    return torch.cat([x.narrow(dim, 0, 1 + K), (quad.index_select(dim, ab) + quad.index_select(dim, ba)) * coef], dim)


def _unfold(x: torch.Tensor, dim: int, K: int, coef: float) -> torch.Tensor:
    """The public layout of packed rows x (1 + K + K (K + 1) / 2 along dim): ordered pair (a, b) coef times the
    row of {a, b}."""
    quad = x.narrow(dim, 1 + K, x.shape[dim] - 1 - K)
    return torch.cat([x.narrow(dim, 0, 1 + K), quad.index_select(dim, _pairs(K, x.device)[2]) * coef], dim)


# How a public state (phi(x) = [1, x, x (x) x / sqrt(2)]) and the kernels' packed rows meet. Forward, the scan
# sums phi_k(k) = [1, k, k_a k_b once a pair] and the read-outs take every ordered pair's q~_a q~_b / 2: a given
# state S0 enters as (S0[ab] + S0[ba]) / sqrt(2), and the sum the scan returns leaves as row / sqrt(2) at both
# orders. Reverse, the scan sums phi_q(q~) = [1, q~, q~_a q~_b / 2 once a pair] and dv, dk read every ordered
# pair: the final state's gradient dF enters as (dF[ab] + dF[ba]) / (2 sqrt(2)), and the initial state's
# gradient leaves as sqrt(2) row at both orders.
_STATE_IN, _STATE_OUT = 2**-0.5, 2**-0.5
_GRAD_IN, _GRAD_OUT = 2**-1.5, 2**0.5


def _packed_state(state, K: int, coef: float):
    """The fp32 (N H, P', V) and (N H, P') packed rows of a public pair (S (N, H, P, V), z (N, H, P))."""
    S, z = state
    return (_fold(S, 2, K, coef).flatten(0, 1).contiguous(), _fold(z, 2, K, coef).flatten(0, 1).contiguous())


def _public_state(packed, N: int, H: int, K: int, coef: float):
    """The public pair (S (N, H, P, V), z (N, H, P)) of the packed fp32 (N H, P', V) and (N H, P') rows."""
    S, z = (x.unflatten(0, (N, H)) for x in packed)
    return _unfold(S, 2, K, coef), _unfold(z, 2, K, coef)


def _sequences(q, cu_seqlens) -> int:
    """N: the batch, or the number of packed sequences."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def _none_if_empty(x):
    """The registered ops pass an absent state (no final state asked for, no initial state given) as an empty
    tensor: None for it."""
    return None if x is None or x.numel() == 0 else x


def based_state_forward_cuda(q, k, v, S0, z0, cu_seqlens, scale: float, output_final_state: bool):
    """(o, S, z) on the path `kernel_path` names for CUDA tensors (the portable forward takes any V); S and z
    empty unless output_final_state."""
    state = None if S0 is None else (S0, z0)
    if kernel_path(q) == "reference":
        o, final = based_forward_reference(q, k, v, scale, initial_state=state, output_final_state=True,
                                           cu_seqlens=cu_seqlens)
    else:
        o, final = portable_state_forward(q, k, v, scale, state, cu_seqlens, output_final_state)
    if output_final_state:
        return (o, *final)
    return o, q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)  # distinct: no aliased returns


def based_state_backward_cuda(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale: float):
    """(dq, dk, dv, dS0, dz0) on the path `kernel_path` names for CUDA tensors: dS and dz empty where the forward
    gave no final state, dS0 and dz0 where it had no initial state. A value size V above the backward kernels'
    bound takes the reference."""
    state = None if S0 is None else (S0, z0)
    d_final = None if _none_if_empty(dS) is None else (dS, dz)
    if kernel_path(q) == "triton":
        from .portable.grads import MAX_V

        if v.shape[-1] <= MAX_V:
            dq, dk, dv, d_initial = portable_state_backward(q, k, v, do, d_final, scale, state, cu_seqlens)
            if d_initial is None:  # distinct empties: a custom op's returns may not alias each other
                d_initial = (q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32))
            return (dq, dk, dv, *d_initial)
    return based_state_backward_reference(q, k, v, do, dS, dz, S0, z0, cu_seqlens, scale)


def portable_state_forward(q, k, v, scale: float, initial_state=None, cu_seqlens=None, output_final_state=True,
                           config: ForwardConfig | None = None):
    """`portable_forward` from an initial state, over packed sequences, and with the final state: returns o and
    the final (S (N, H, P, V), z (N, H, P)), fp32, P = 1 + K + K^2 (None unless output_final_state).

    initial_state: None (zero) or the fp32 pair (S0, z0) of that layout; cu_seqlens: None or the N + 1 offsets
    of N sequences packed in a B = 1 batch, read on the device only (the buffers and grids take the bound
    (T + N (C - 1)) // C on the chunk count). The scan runs from the packed initial state; the steps' sum (its
    end less its start, in packed rows) is unfolded and added to the given state, which keeps any part of it that
    the packed rows do not hold (an S0[ab] - S0[ba] no read-out sees)."""
    from .portable import output, states

    if q.dtype == torch.float16:
        o, final = portable_state_forward(*(x.to(torch.bfloat16) for x in (q, k, v)), scale, initial_state,
                                          cu_seqlens, output_final_state, config)
        return o.to(torch.float16), final
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = _sequences(q, cu_seqlens)
    cfg = config or forward_config(K, q.device)
    packing = None if cu_seqlens is None else states.packing(cu_seqlens, T, cfg.chunk, cfg.scan_segment_chunks)
    S, Z = states.state_buffers(q, V, cfg.chunk, packing)
    P = S.shape[2]
    initial = None if initial_state is None else _packed_state(initial_state, K, _STATE_IN)
    final = None
    if output_final_state:
        final = (torch.empty(N * H, P, V, device=q.device), torch.empty(N * H, P, device=q.device))
    o = torch.empty_like(v)
    with on_device(q):
        states.launch(k, v, Z, S, Z, scale, chunk=cfg.chunk, reverse=False, rows=cfg.scan_rows, bv=cfg.scan_bv,
                      warps=cfg.scan_warps, stages=cfg.scan_stages, initial=initial, final=final, packing=packing)
        output.launch(q, k, v, S, Z, o, scale, chunk=cfg.chunk, bv=cfg.bv, warps=cfg.warps, packing=packing)
    if final is None:
        return o, None
    if initial is not None:  # the final state is the given one plus the steps' sum, taken apart in packed rows
        final = tuple(x - x0 for x, x0 in zip(final, initial))
    S_end, z_end = _public_state(final, N, H, K, _STATE_OUT)
    if initial_state is not None:
        S_end, z_end = S_end + initial_state[0], z_end + initial_state[1]
    return o, (S_end, z_end)


def portable_state_backward(q, k, v, do, d_final, scale: float, initial_state=None, cu_seqlens=None,
                            config: BackwardConfig | None = None):
    """(dq, dk, dv, (dS0, dz0)) of `portable_state_forward`'s o and final state, for the gradients do of o and
    d_final = (dS, dz) of the final state (None: the forward gave none); (dS0, dz0), fp32, the initial state's
    gradients, None where initial_state is None.

    The forward scan starts from the initial state; the reverse scan from the final state's gradient, and its
    sum over all chunks (its end less its start) is the initial state's gradient through o (the final state's
    adds directly)."""
    from .portable import grads, states

    if q.dtype == torch.float16:
        *got, d_initial = portable_state_backward(*(x.to(torch.bfloat16) for x in (q, k, v, do)), d_final, scale,
                                                  initial_state, cu_seqlens, config)
        return (*(x.to(torch.float16) for x in got), d_initial)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if V > grads.MAX_V:
        raise ValueError(f"the fused backward holds V whole in a program: V <= {grads.MAX_V}, got V={V}")
    N = _sequences(q, cu_seqlens)
    cfg = config or backward_config(K)
    packing = None if cu_seqlens is None else states.packing(cu_seqlens, T, cfg.chunk, cfg.scan_segment_chunks)
    S, Z = states.state_buffers(q, V, cfg.chunk, packing)
    P = S.shape[2]
    h = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    g = torch.empty_like(do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    initial = None if initial_state is None else _packed_state(initial_state, K, _STATE_IN)
    d_start = None if d_final is None else _packed_state(d_final, K, _GRAD_IN)
    total = None
    if initial_state is not None:
        total = (torch.empty(N * H, P, V, device=q.device), torch.empty(N * H, P, device=q.device))
    scan = dict(chunk=cfg.chunk, rows=cfg.scan_rows, bv=cfg.scan_bv, warps=cfg.scan_warps, stages=cfg.scan_stages,
                packing=packing)
    chunk = dict(chunk=cfg.chunk, warps=cfg.warps, registers=cfg.chunk_registers, packing=packing)
    with on_device(q):
        states.launch(k, v, h, S, Z, scale, reverse=False, initial=initial, **scan)
        grads.launch_dq(q, k, v, do, S, Z, h, g, dq, scale, **chunk)
        states.launch(q, g, h, S, Z, scale, reverse=True, initial=d_start, final=total, **scan)
        grads.launch_dkdv(q, k, v, g, S, Z, h, dk, dv, scale, **chunk)
    if total is None:
        return dq, dk, dv, None
    if d_start is not None:
        total = tuple(x - x0 for x, x0 in zip(total, d_start))
    dS0, dz0 = _public_state(total, N, H, K, _GRAD_OUT)
    if d_final is not None:
        dS0, dz0 = dS0 + d_final[0], dz0 + d_final[1]
    return dq, dk, dv, (dS0, dz0)
