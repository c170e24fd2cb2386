"""The fast paths of ldsa on sm_90, run where `dispatch.FAST_PATHS` says they are verified: the band kernels fed by
tensor descriptors (`band_tma`, band-tma), and the band forward and backward in Gluon (`band_forward`,
`band_backward`, band-gluon) with what those two share (`band_mma`)."""
