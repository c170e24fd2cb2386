"""The portable Triton kernels, one module per stage, each with its launch: `states` (the chunk state scan),
`output` (the forward's output), `grads` (the backward's dq and dk, dv); `tiles` holds the jit helpers they
share. `dispatch` runs the stages in order. Imported only where the kernels run (the package imports without
triton)."""
