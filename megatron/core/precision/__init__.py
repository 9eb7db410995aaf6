"""Training precision applied to a built model: the low-precision working copies of the linear layers'
weights (`weight_copies`) and the copy a layer's forward reads (`working_copy`)."""
