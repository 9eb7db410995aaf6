"""Float8 training: the float8 GEMMs and their scaling (tensorwise, delayed), the float8 SwiGLU MLP,
and the torchao float8 linears (`torchao_float8`). Where is fp8? Here (its kernels in ../fusions/)."""
