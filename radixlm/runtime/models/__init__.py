"""Model families (one module each, chosen by `registry`), their shared layers, and model
loading (GGUF conversion, config normalization, weights)."""

import os

# NOTE: set before transformers / huggingface_hub are imported by any module of this package
# (`loader`, `model_info`); every from_pretrained also passes local_files_only=True regardless.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
