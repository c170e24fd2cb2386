"""The portable Triton kernels, one module per stage, each with its own launcher. Imported only on the CUDA path
(the package imports without triton)."""
