"""Float8 training: the float8 GEMMs and their scaling (tensorwise, delayed) and the float8 SwiGLU MLP,
which the decoder's linear layers run from float8 working copies of their weights (../precision/).
Where is fp8? Here (its kernels in ../fusions/)."""
