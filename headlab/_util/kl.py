"""KL(teacher || student) over a large vocabulary, a few rows of logits at a time.

Written with torch's operators, KL(softmax(t) || softmax(s)) on (B, T, V) logits keeps
about six (B, T, V) temporaries for its backward, and each pass over them is a fresh
allocation: at Gemma-3's 262k vocabulary, 1024 rows are 1 GiB per tensor, and the loss
took as long as the model's forward and backward together. Here the value and the
gradient with respect to the student's logits come from one pass over chunks of rows
that stay in the cache, and only the gradient (B, T, V) is kept. Rows of weight 0 (not
scored) are skipped, and their gradient is 0.
"""

from __future__ import annotations

import torch

_CHUNK_VALUES = 1 << 21  # values per chunk of rows: 8 MiB of float32


def weighted_kl(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
                temperature: float = 1.0) -> torch.Tensor:
    """sum_r w_r KL(softmax(t_r / T) || softmax(s_r / T)) / sum_r w_r, a scalar, for
    logits ``student``, ``teacher`` (B, T, V) and ``weights`` (B, T); differentiable in
    ``student`` (float32; the teacher's carry no gradient). 0 where every weight is 0."""
    return _WeightedKL.apply(student, teacher.detach(), weights.detach(), temperature)


class _WeightedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, t, w, temperature):
        B, T, V = s.shape
        scale = w / w.sum().clamp(min=1e-30) / temperature  # (B, T): w_r / sum w / T
        new = torch.empty if bool((w > 0).all()) else torch.zeros  # rows not scored: 0
        grad = new(B, T, V, dtype=s.dtype, device=s.device)  # (B, T, V)
        value = torch.zeros((), dtype=torch.float64, device=s.device)
        step = max(1, _CHUNK_VALUES // max(V, 1))
        for b in range(B):
            scored = torch.nonzero(w[b] > 0).flatten().tolist()
            for a in range(0, len(scored), step):
                rows = scored[a:a + step]
                # a run of positions is a view; scattered ones (masked LM) are gathered
                at = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 \
                    else torch.tensor(rows, device=s.device)
                log_s = (s[b, at] / temperature).log_softmax(-1)  # (n, V)
                log_t = (t[b, at].to(s.dtype) / temperature).log_softmax(-1)
                p_t = log_t.exp()
                c = scale[b, at]  # (n,)
                value += (c * (p_t * (log_t - log_s)).sum(-1)).sum(dtype=torch.float64)
                # d/ds of T^-1-weighted KL: (softmax(s/T) - softmax(t/T)) * w_r / sum w / T
                grad[b, at] = log_s.exp_().sub_(p_t).mul_(c[:, None])
        ctx.save_for_backward(grad)
        return (value * temperature).to(s.dtype)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None, None
