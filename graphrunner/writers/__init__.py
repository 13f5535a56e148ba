"""Populate and its writers: the torch reference (`base`), the fused Triton
launch (`fused`, `fused_kernel`) and the pinned staging ring (`staging`)."""
