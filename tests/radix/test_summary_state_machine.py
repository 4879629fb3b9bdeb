"""The incremental tree summary equals a full recomputation after any sequence of operations.

Extends the radix state machine (`test_radix_state_machine.RadixMachine`, whose rules and model
it inherits) with a model of per-node hit counts: for every page-aligned prefix, the matches whose
result covered it since the prefix was (last) inserted. A node's `hits` must equal the count of
the prefix ending at the node's end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from hypothesis import settings
from hypothesis.stateful import invariant
from test_radix_state_machine import NAMESPACES, RadixMachine

from radixlm.radix.summary import SummaryOptions, summarize, summarize_full

OPTIONS = [
    SummaryOptions(),
    SummaryOptions(max_depth=2, max_children=1, max_nodes=4),
    SummaryOptions(max_depth=3, max_children=2, max_nodes=6, include_tokens=True),
]


class SummaryMachine(RadixMachine):
    def checked_match(self, tokens: list[int], ns: Hashable | None):
        m = super().checked_match(tokens, ns)
        if not hasattr(self, "hits"):
            self.hits: dict[Hashable | None, Counter] = {n: Counter() for n in NAMESPACES}
        for j in range(1, len(m.pages) + 1):
            self.hits[ns][tuple(tokens[: j * self.ps])] += 1
        return m

    @invariant()
    def summary_equals_full_recomputation(self) -> None:
        for opts in OPTIONS:
            assert summarize(self.cache, opts) == summarize_full(self.cache, opts)

    @invariant()
    def node_hits_match_the_model(self) -> None:
        if not hasattr(self, "hits"):
            return
        for ns in NAMESPACES:
            present = self.cache.page_map(ns)
            counts = self.hits[ns]
            for key in [k for k in counts if k not in present]:
                del counts[key]  # evicted: a re-inserted prefix starts from zero
            root = self.cache.roots().get(ns)
            stack = [(c, ()) for c in root.children.values()] if root else []
            while stack:
                node, prefix = stack.pop()
                path = prefix + node.key
                assert node.hits == counts[path], (path, node.hits, counts[path])
                stack.extend((c, path) for c in node.children.values())


SummaryMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestSummaryStateMachine = SummaryMachine.TestCase
