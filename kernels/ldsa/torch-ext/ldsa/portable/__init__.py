"""The Triton kernels of ldsa for every CUDA GPU the metadata admits: the band kernels (`band`), the tensor-core
products and window weights that every kernel of the package shares (`products`, `window_weights`), and the launcher
every kernel runs through (`launch`)."""
