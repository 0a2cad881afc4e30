"""Apply a profile as a per-layer merging/eviction KV cache inside transformers generation."""
