"""Model definitions and model loading (GGUF conversion, config normalization, weights)."""
