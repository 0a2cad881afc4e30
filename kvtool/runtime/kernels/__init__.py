"""Fused GPU kernels of the prompt pass (optional: they need Triton, which ships with CUDA builds of torch).

`triton_scores.attention_with_scores_triton`: the causal attention output of a left-padded prompt and the
column sums of its softmax probabilities (kvtool's importance), without an n x n tensor. Import the
submodule only after `triton_scores.available(...)` said yes; this package imports nothing itself.
"""
