"""Tensor parallelism over `torch.distributed`: process groups (`parallel_state`), Megatron
sharding of the Llama-family model at load time (`sharding`), and rank 0's runner that
broadcasts each step to the other ranks (`tp_runner`)."""

from __future__ import annotations
