"""Structured generation: constraints, grammar backends, bitmasks, jump-forward, the verifier.

The modules, from the leaves up (each imports only those above it in this list):

- ``errors``: ``GrammarError``, ``GrammarTimeoutError``.
- ``schema_keywords``, ``schema_text``: keyword tables; a schema's shape limits and canonical
  text. ``tool_calls`` (top level) builds on them.
- ``constraint``: ``Constraint``, what a request's output must match (torch-free).
- the schema pipeline: ``normalize`` (+ ``normalize_cases``), ``relax``, ``strict``,
  ``verifier``, ``patterns``, ``formats``, ``disjoint``, ``subsume``, ``schema_merge``.
- ``bitmask``, ``vocab``, ``base`` (matcher / compiled grammar / backend interface and the
  backend registry), the backends (``xgrammar_backend``, ``outlines_backend``,
  ``llguidance_backend``, ``auto_backend``; imported on first use), ``verified``,
  ``jump_forward``, ``manager``.

Use::

    manager = GrammarManager(tokenizer, vocab_size, eos_token_ids, backend="xgrammar")
    constraint = Constraint.from_params(json_schema=schema)      # None when unconstrained
    manager.validate(constraint)                                 # cheap; GrammarError -> 400
    future = manager.submit(constraint)                          # Future[CompiledGrammar]
    matcher = future.result().new_matcher()                      # one per sequence
    matcher.fill_bitmask(bitmask, row)                           # per constrained row
    apply_token_bitmask(logits, bitmask, rows)                   # one batched call
    matcher.accept_token(token)                                  # after sampling
    jf = manager.jump_forward(matcher, [token], max_tokens=...)  # forced continuation

This package's ``__init__`` imports only ``native`` (torch-free, as ``constraint`` and
``errors`` are): import names from their modules. ``native.install`` puts the mypyc build of
the verifier (``json_track``, ``trackers``, ``verifier``, ``verified``) first on this package's
path when one is built for these sources (``native.main``, run by ``scripts/setup.sh``).
"""

from radixlm.runtime.grammar import native as _native

_native.install(__path__)
