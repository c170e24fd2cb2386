"""The Hopper Gluon kernels of ldsa (band-gluon): the forward (`forward`) and the backward (`backward`), each with its
launch, and what they share (`band`)."""
