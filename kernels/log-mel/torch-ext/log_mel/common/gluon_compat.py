# Generated from common/gluon_compat.py by `python -m tools.vendor`: edit that file, not this copy.
"""The Gluon names that differ between the Triton releases the package supports (3.6 to 3.9), resolved once at
import for the installed Triton, so that every kernel is written against one vocabulary:

| name here                                | Triton 3.6 and 3.7                                | 3.8 and 3.9           |
|------------------------------------------|---------------------------------------------------|-----------------------|
| `barrier()`: all threads of the CTA      | `gl.thread_barrier` (3.6), `gl.barrier` (3.7)     | `gl.barrier`          |
| `tma_load(desc, coord, bar, dest, pred)` | `tma.async_copy_global_to_shared`                 | `tma.async_load`      |
| `tma_store(desc, coord, src)`            | `tma.async_copy_shared_to_global`                 | `tma.async_store`     |
| `reinterpret(buf, dtype, shape, layout)` | `buf._reinterpret`                                | 3.9: `reinterpret`    |

What cannot be adapted here: from 3.8 a shared buffer in a padded layout may be reinterpreted only as a layout of
the same padding pattern, so a kernel that reads a buffer through views of other row strides than it was stored with
addresses those cells another way from 3.8 on (ldsa's Gluon backward gathers and scatters them).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """`buf`'s bytes viewed as a `shape` descriptor of `dtype` laid out as `layout`."""
    if _PUBLIC_REINTERPRET:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)
