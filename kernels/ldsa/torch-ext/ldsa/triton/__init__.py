"""The Triton kernels of ldsa, by stage: the portable band kernels (`band`), the TMA-fed band kernels (`band_tma`),
the tensor-core products and window weights they share (`products`, `window_weights`), and the launcher every
kernel of the package runs through (`launch`)."""
