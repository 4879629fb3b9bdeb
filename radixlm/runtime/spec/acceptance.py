"""Rejection sampling for a draft drawn from a distribution (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

Invariant: whatever `q` is, the tokens emitted are distributed exactly as the target `p` would
emit them one at a time (the draft only changes how many stand per step).
"""

from __future__ import annotations

import torch

from radixlm.runtime.sampler import pick


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, draft: list[int], u: torch.Tensor
) -> tuple[int, int]:
    """Verify `draft` (k tokens, token i drawn from `q[i]`) against the target.

    `p` `[k + 1, V]`: the target's distribution at each draft position and the one after;
    `q` `[k, V]`: the draft's; `u` `[k + 1]` independent U[0, 1). Draft token i stands while
    `u[i] < p[i, d_i] / q[i, d_i]` (accepted with probability min(1, p / q)); at the first
    rejection the next token is drawn (with `u[k]`) from norm(max(0, p[i] - q[i])), after a
    whole accepted draft from `p[k]`. Returns (tokens accepted, the token after them)."""
    k = len(draft)
    if k:
        d = torch.tensor(draft, device=p.device)[:, None]  # [k, 1]
        p_d = p[:k].gather(1, d)[:, 0]  # [k]
        q_d = q.gather(1, d)[:, 0]  # [k]
        ok = (u[:k].to(p.device) * q_d < p_d).tolist()
        a = ok.index(False) if False in ok else k
    else:
        a = 0
    if a < k:
        residual = (p[a] - q[a]).clamp_min(0.0)  # [V]
        if not float(residual.sum()) > 0.0:  # p == q there: the rejection had probability 0
            residual = p[a]
    else:
        residual = p[k]
    tok = int(pick(residual[None, :], u[k : k + 1].to(p.device))[0])
    return a, tok
