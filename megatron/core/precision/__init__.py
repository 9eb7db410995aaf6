"""Training precision applied to a built model: `apply.apply_precision(model, PrecisionConfig, ...)` swaps the
layers' GEMMs for ones reading working copies of their weights (`working_copy.CopyGemm`, bf16/fp16; float8:
../fp8/float8_copy.py) and returns the `weight_copies.WeightCopies` that keep them fresh."""
