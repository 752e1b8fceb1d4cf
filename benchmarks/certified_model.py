"""How often a certified walk's greedy decision needs an exact round, on the benchmarks' head, in NumPy.

The head and inputs are those of benchmarks/profile_kernel.py (W1, W2 of 0.05 N(0, 1) in bf16, base
logits N(0, 1)), W2 quantized by `quantize(head, certified=True)`, whose residual norms bound each row's
quantization error. A decision is the greedy choice of one request at one step, e the W1 row of a
random token. Its bound keeps the leading
term of the kernel's margin (docs/kernel_design.md, section 8): M = rho ||e||_2, with rho the largest
residual norm of the CTA's rows (132 CTAs of contiguous rows) or of the whole head. A decision needs an
exact round where some column other than the int8 winner w has an upper bound s_v + M that reaches the
winner's lower bound s_w - M, judged three ways:
  - CTA margins: each column's CTA margin, and the winner's CTA's for w (the direct exchange today);
  - global margin: the head's margin for every column (every CTA computes the same M);
  - mixed: the head's margin for w, each CTA's own for its columns (a CTA checks its columns alone).
It prints, for each, the fraction of decisions and the chance that a step of B requests holds at least
one such decision, and how often the exact choice differs from the int8 winner at all.

    python3 benchmarks/certified_model.py [--decisions 300] [--out benchmarks/results/certified_model.md]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import jax_markov as jm

VOCAB, RANK, CTAS = 151936, 256, 132
BATCHES = (1, 16, 64)


def model(decisions: int, vocab: int = VOCAB, seed: int = 0) -> tuple[dict[str, int], int, list[int]]:
    """Decisions that need an exact round under each margin, decisions whose exact choice differs
    from the int8 winner, and each decision's columns besides the winner within the head margin's bounds."""
    rng = np.random.default_rng(seed)
    w1 = jnp.asarray(rng.standard_normal((vocab, RANK), np.float32) * 0.05, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((vocab, RANK), np.float32) * 0.05, jnp.bfloat16)
    head = jm.quantize(jm.MarkovHead(w1, w2), certified=True)
    w1, w2 = np.asarray(w1, np.float32), np.asarray(w2, np.float32)
    q = head.quantized
    w2q = np.asarray(q.scale)[:, None] * np.asarray(q.q, np.float32)
    residual = np.asarray(head.residual_norm)
    cta = np.arange(vocab) // -(-vocab // CTAS)
    r_cta = np.zeros(CTAS)
    np.maximum.at(r_cta, cta, residual)
    r_head = residual.max()
    counts = {"CTA margins": 0, "global margin": 0, "mixed": 0}
    differ, candidates = 0, []
    for _ in range(decisions):
        e = w1[rng.integers(vocab)]
        base = rng.standard_normal(vocab).astype(np.float32)
        s = base + w2q @ e
        w = int(np.argmax(s))
        differ += int(np.argmax(base + w2 @ e)) != w
        norm = float(np.linalg.norm(e))
        m_cta, m_head = r_cta * norm, r_head * norm
        others = s.copy()
        others[w] = -np.inf
        best_other = np.full(CTAS, -np.inf)
        np.maximum.at(best_other, cta, others)
        counts["CTA margins"] += (best_other + m_cta).max() >= s[w] - m_cta[cta[w]]
        counts["global margin"] += (best_other + m_head).max() >= s[w] - m_head
        counts["mixed"] += (best_other + m_cta).max() >= s[w] - m_head
        candidates.append(int((others + m_head >= s[w] - m_head).sum()))
    return counts, differ, candidates


def report(decisions: int) -> str:
    counts, differ, candidates = model(decisions)
    lines = [f"# Exact rounds of the certified walk on the benchmarks' head (NumPy model)", "",
             f"- command: `python3 benchmarks/certified_model.py --decisions {decisions}`",
             f"- V = {VOCAB}, rank {RANK}, {CTAS} CTAs of contiguous rows; {decisions} decisions (seed 0)",
             f"- the exact choice differs from the int8 winner at {differ} of {decisions} decisions; columns "
             f"besides the winner within the global margin's bounds: mean {np.mean(candidates):.3f}, most {max(candidates)}",
             "", "| margins | decisions with an exact round | fraction | "
             + " | ".join(f"P(a step of {b} has one)" for b in BATCHES) + " |",
             "|---|---|---|" + "---|" * len(BATCHES)]
    for name, n in counts.items():
        p = n / decisions
        lines.append(f"| {name} | {n} of {decisions} | {p:.3f} | "
                     + " | ".join(f"{1 - (1 - p) ** b:.3f}" for b in BATCHES) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decisions", type=int, default=300)
    p.add_argument("--out", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    text = report(args.decisions)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
