"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling, after
the request's penalties; and the log-probabilities of what was chosen, for requests that
ask (docs/serving.md, "Log-probabilities and penalties").

Per request and step, in this order: the raw logits row -> its grammar's mask (only
for a request with a ``guide``: the tokens the grammar forbids get -inf,
engine/structured.py; the masks are packed bits, one int32 per 32 tokens, and a greedy
guided row is chosen in one native pass over its logits and bits, no row copied) ->
penalties (only when the request sets one: repetition, then
frequency and presence) -> greedy argmax, or temperature, top-k, top-p and a draw
(``_candidates``, ``_inverse_cdf``: one uniform per token drawn).
Logprobs are the log-softmax of the raw row, whatever changed it for the choice; a
prompt's (``prompt_logprobs``) are those of the prompt's own positions. A
request that sets no guide, penalties or logprobs costs what it did before, whatever
else shares its batch: a greedy one is one row of the batch's argmax.

A seeded request's draw for output position ``p`` (the number of output tokens before
the one drawn) comes from a generator seeded with ``position_seed(seed, p)`` and from
nothing else: its tokens do not depend on what else is in the batch, on preemptions,
or on which process draws them, so a request resumed elsewhere from its first ``p``
output tokens draws what an uninterrupted run would. Unseeded requests share the
engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.cpu_ops import CpuOps, cpu_ops
from pdserve.engine.outputs import Logprobs
from pdserve.engine.request import Request

_MASK64 = (1 << 64) - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max
NUCLEUS_PROBE = 256  # top-p: the most likely tokens looked at before the whole row


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output ``position``: the
    ``position + 1``-th output of splitmix64 started from ``seed`` (its 64 bits, two's
    complement for a negative seed). Distinct positions give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class Sample:
    """One request's draw in a step: the token, and its ``Logprobs`` when the request
    asked for them (``SamplingParams.logprobs`` not None), else None. ``choices``: at
    the draw that forks a request's other choices (``Request.forks_now``), the first
    token (and logprobs) of choice 1, 2, .. drawn from the same logits."""

    request: Request
    token: int
    logprobs: Logprobs | None = None
    choices: list[tuple[int, Logprobs | None]] = field(default_factory=list)
    # the tokens after ``token`` that a speculative step confirmed (engine/speculative.py)
    more: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[Sample]:
        """``self(logits, requests)`` with the logprobs of the requests that ask, and the
        other choices' first tokens of those that fork now."""
        tokens = self(logits, requests)
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        found = dict(zip(asking, _logprobs(logits, asking, requests, tokens), strict=True))
        pairs = enumerate(zip(requests, tokens, strict=True))
        samples = [Sample(r, t, found.get(i)) for i, (r, t) in pairs]
        for i, s in enumerate(samples):
            if s.request.forks_now:
                s.choices = self._choices(logits[i], s.request)
        return samples

    def _choices(self, row: torch.Tensor, request: Request) -> list[tuple[int, Logprobs | None]]:
        """Choices 1 .. n - 1's first tokens from ``request``'s logits ``row`` [V]: each
        drawn as the request would alone with seed + i (unseeded: the engine's
        generator, in order), under the same mask and penalties."""
        p = request.params
        choices = range(1, p.n)
        masked = row
        if request.matcher is not None:
            masked = _masked_row(row, _grammar_bits(row.shape[-1], [request])[0])
        tokens = [
            self._draw(masked, request, None if p.seed is None else p.seed + c) for c in choices
        ]
        if p.logprobs is None:
            return [(t, None) for t in tokens]
        rows = list(range(len(tokens)))
        lps = _logprobs(row.expand(len(tokens), -1), rows, [request] * len(tokens), tokens)
        return list(zip(tokens, lps, strict=True))

    def _draw(self, row: torch.Tensor, request: Request, seed: int | None, ahead: int = 0) -> int:
        """One token from a (masked) logits row [V] under ``request``'s penalties and
        sampling, a seeded draw keyed by (``seed``, output position); ``ahead``: the
        position is that many past the request's next (a speculative step's rows)."""
        p = request.params
        row = penalize(row, request) if p.penalized else row
        if p.greedy:
            return int(row.argmax())
        weights, ids = _candidates(row, p.temperature, p.top_k, p.top_p)
        gen = self.generator
        if seed is not None:
            position = request.num_output_tokens + ahead
            gen = torch.Generator().manual_seed(position_seed(seed, position))
        i = _inverse_cdf(weights, gen)
        return i if ids is None else int(ids[i])

    def verify(self, rows: torch.Tensor, request: Request) -> list[int]:
        """A sampled request's draws over its speculative step's rows [1 + len(draft), V]
        (engine/speculative.py): row j drawn as the plain request would draw its output
        at position j past its next, until one differs from the draft's guess there
        (that draw is the last) or every guess held (the next row's draw follows)."""
        draft, out = request.draft, []
        for j in range(len(draft) + 1):
            out.append(self._draw(rows[j], request, request.params.seed, ahead=j))
            if j < len(draft) and out[j] != draft[j]:
                break
        return out

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [S, V] float32, one row per request -> one token id per request, drawn
        at each request's current output position (``num_output_tokens``)."""
        native = cpu_ops() if CpuOps.supports(logits) and logits.dim() == 2 else None
        greedy = (logits.argmax(dim=-1) if native is None else native.argmax(logits)).tolist()
        # a guided greedy row whose own argmax its grammar allows is that argmax: its mask
        # (llguidance's dearest part, most steps) is computed only when the argmax is not
        guided = [
            i
            for i, r in enumerate(requests)
            if r.matcher is not None
            and not (r.params.greedy and not r.params.penalized and r.matcher.allows(greedy[i]))
        ]
        if guided:
            bits = _grammar_bits(logits.shape[-1], [requests[i] for i in guided])
            if native is not None and logits.stride(-1) == 1:
                chosen = native.masked_argmax(logits, guided, bits)
                for i, token in zip(guided, chosen, strict=True):
                    greedy[i] = token
            else:
                for j, i in enumerate(guided):
                    greedy[i] = int(_masked_row(logits[i], bits[j]).argmax())
        where = {i: j for j, i in enumerate(guided)}  # request row -> its row of bits
        out = []
        for i, request in enumerate(requests):
            p, j = request.params, where.get(i)
            if p.greedy and not p.penalized:
                out.append(greedy[i])
                continue
            row = logits[i] if j is None else _masked_row(logits[i], bits[j])
            out.append(self._draw(row, request, p.seed))
        return out


def _grammar_bits(vocab: int, requests: list[Request]) -> torch.Tensor:
    """The tokens each guided request's grammar allows next, packed: int32 [len(requests),
    ceil(vocab / 32)], token t at bit t % 32 of word t // 32 (llguidance's layout)."""
    bits = torch.empty(len(requests), (vocab + 31) // 32, dtype=torch.int32)
    for j, request in enumerate(requests):
        request.matcher.fill(bits[j])
    # a grammar that allows no token of the vocabulary (it needs a byte no token spells)
    # masks nothing: whatever is drawn leaves the grammar, which ends that request alone
    bits[~bits.any(dim=1)] = -1
    return bits


def _masked_row(row: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """A copy of one logits row [V] with -inf where ``bits`` (int32 [ceil(V / 32)],
    ``_grammar_bits``' layout) has the token's bit clear."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits[:, None] >> shifts) & 1).reshape(-1)[: row.shape[0]].bool()
    return row.masked_fill(~allowed, float("-inf"))


def _candidates(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a sampled draw chooses among: (weights, ids), the probabilities (not
    renormalized) of the tokens temperature, top-k and top-p keep, and those tokens'
    ids; ids None: ``weights`` covers the whole vocabulary, index = token id.

    top-p keeps the most likely tokens, in descending order, until the mass before one
    reaches ``top_p`` (the first always). Only the ``NUCLEUS_PROBE`` most likely are
    sorted (``topk``) when they hold ``top_p`` of the mass, which settles where the
    nucleus ends; the whole row only otherwise (a sort of the vocabulary costs more than
    the rest of the draw, docs/performance.md)."""
    # a temperature past float32's range would be inf in the division, and a masked
    # token's -inf / inf is NaN: float32's largest finite number divides to the same ~0
    row = row / min(temperature, _FLOAT32_MAX)
    vocab = row.numel()
    if 0 < top_k < vocab:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p >= 1.0:
        return probs, None
    values, ids = torch.topk(probs, min(NUCLEUS_PROBE, vocab))
    mass = values.cumsum(0)
    if len(values) < vocab and float(mass[-1]) < top_p:
        values, ids = probs.sort(descending=True)
        mass = values.cumsum(0)
    # a top_p below float32's range compares as 0, which would drop every token: the
    # first is kept whatever the mass before it
    kept = max(1, int((mass - values < top_p).sum()))
    return values[:kept], ids[:kept]


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn with probability ``weights[i] / weights.sum()``: one uniform u from
    ``generator``, the first index whose cumulative weight (float64) passes u times the
    total. A zero weight is never drawn (its cumulative weight equals the one before).
    One draw of the generator per token sampled, where ``torch.multinomial`` draws one
    per vocabulary entry."""
    cdf = torch.cumsum(weights, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    # u * total rounded up to the total: the last token with a weight
    return i if i < len(cdf) else int(torch.nonzero(weights)[-1])


def penalize(row: torch.Tensor, request: Request) -> torch.Tensor:
    """A copy of one logits row [V] with the request's penalties applied, over its tokens
    so far (prompt + output, a resumed request's delivered output included; not yet the
    token being drawn):

    - ``repetition_penalty`` r (HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's): for
      every distinct token of prompt + output, a negative logit is multiplied by r and
      any other divided by r;
    - then OpenAI's ``frequency_penalty`` f and ``presence_penalty`` p over the output
      tokens: ``logit[j] -= count[j] * f + (count[j] > 0) * p``."""
    p = request.params
    row = row.clone()
    if p.repetition_penalty != 1:
        seen = torch.tensor(request.token_ids, device=row.device).unique()
        s = row[seen]
        row[seen] = torch.where(s < 0, s * p.repetition_penalty, s / p.repetition_penalty)
    output = request.output_token_ids
    if (p.frequency_penalty or p.presence_penalty) and output:
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row[ids] -= counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty
    return row


def _logprobs(
    logits: torch.Tensor, rows: list[int], requests: list[Request], tokens: list[int]
) -> list[Logprobs]:
    """The ``Logprobs`` of the chosen tokens of ``rows``: log-softmax of the raw logits,
    with each row's request's ``params.logprobs`` most likely tokens."""
    if not rows:
        return []
    lp = torch.log_softmax(logits[rows], dim=-1)
    k = min(max(requests[i].params.logprobs for i in rows), lp.shape[-1])
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    picked = torch.tensor([tokens[i] for i in rows], device=lp.device)
    chosen = lp.gather(1, picked[:, None])[:, 0].tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out = []
    for j, i in enumerate(rows):
        n = requests[i].params.logprobs
        out.append(Logprobs(tokens[i], chosen[j], tuple(top_ids[j][:n]), tuple(top_values[j][:n])))
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[Logprobs]:
    """Prompt tokens' ``Logprobs`` (``SamplingParams.prompt_logprobs``): row i of
    ``logits`` [R, V] is the position before prompt token ``targets[i]``; each gets its
    log-softmax value, its rank and the ``ks[i]`` most likely tokens."""
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    ranks = ((lp > picked).sum(dim=1) + 1).tolist()
    k = min(max(ks), lp.shape[-1])
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), picked[:, 0].tolist()
    return [
        Logprobs(t, chosen[i], tuple(top_ids[i][:n]), tuple(top_values[i][:n]), ranks[i])
        for i, (t, n) in enumerate(zip(targets, ks, strict=True))
    ]
