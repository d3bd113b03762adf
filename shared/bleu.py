"""Corpus BLEU (Papineni et al. 2002): n-gram precisions up to 4, geometric mean, brevity penalty, one
reference per hypothesis, no smoothing; 0..1. Our own few lines rather than sacrebleu: `specfleet validate`
compares two outputs of the same model (speculative vs plain), tokenized by the model itself (token ids), so
sacrebleu's text tokenizers and signature add nothing, and the fleet's image stays one dependency smaller."""

import math
from collections import Counter
from collections.abc import Sequence

MAX_ORDER = 4


def _ngrams(tokens: Sequence[object], n: int) -> Counter[tuple[object, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def corpus_bleu(hypotheses: Sequence[Sequence[object]], references: Sequence[Sequence[object]]) -> float:
    """BLEU of `hypotheses` against `references` (token sequences, pairwise); 1.0 for identical corpora."""
    matches, totals = [0] * MAX_ORDER, [0] * MAX_ORDER
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        hyp_len, ref_len = hyp_len + len(hyp), ref_len + len(ref)
        for n in range(1, MAX_ORDER + 1):
            hyp_counts, ref_counts = _ngrams(hyp, n), _ngrams(ref, n)
            matches[n - 1] += sum(min(count, ref_counts[gram]) for gram, count in hyp_counts.items())
            totals[n - 1] += max(0, len(hyp) - n + 1)
    if hyp_len == 0 or min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / MAX_ORDER
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return brevity * math.exp(log_precision)
