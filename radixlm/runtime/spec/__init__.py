"""Speculative decoding with a draft model: the draft model's proposals (`draft_model.py`) and
the acceptance rule for a sampled draft (`acceptance.py`). Draft-model-free drafting (prompt
lookup, the radix tree) is the scheduler's `Drafter`."""
