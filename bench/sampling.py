"""The sampler's draw against the one it replaced, per row and in decode steps, on the
embedded model (vocabulary 49152, 2 threads).

    .venv/bin/python -m pdserve.bench.sampling [--batches 1,8,32] [--steps 32] [--repeats 3]

The replaced draw, kept here as the baseline (the feature off): ``torch.multinomial``
over the whole filtered distribution (one exponential per vocabulary entry), after a
sort of the whole row for top-p. The engine's (engine/sampler.py ``_candidates`` and
``_inverse_cdf``): top-p looks at the 256 most likely tokens first, and a draw takes
one uniform and a cumulative sum.

1. Per row: median microseconds of one draw, both ways, for temperature 0.8 alone and
   with top-p 0.95, over logits rows of the model itself. Before any figure is printed,
   both draws' token frequencies over a small row are checked against its exact
   filtered distribution (total variation under 0.02 each): a faster draw from another
   distribution is not a result.
2. Decode: tokens/s of batches of 128-token contexts, greedy (the ceiling: a sampled
   step does what a greedy one does and draws), sampled with the engine's draw, and
   sampled with the replaced draw patched in, best of ``--repeats`` alternating runs.
   A sampled run faster than greedy by more than 5% is a broken measurement: the bench
   says so and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from pdserve.engine import LLM, SamplingParams, native
from pdserve.engine import sampler as engine_sampler

MODEL = "smollm2-135m"
SAMPLED = {"plain": dict(temperature=0.8), "top-p 0.95": dict(temperature=0.8, top_p=0.95)}


def replaced_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The distribution engine/sampler.py drew from before (at 2bca1b3): the whole row's
    filtered probabilities, top-p by a sort of the whole row."""
    row = row / temperature
    if 0 < top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        drop[0] = False
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs / sorted_probs.sum())
    return probs


def replaced_draw(row: torch.Tensor, temperature: float, top_k: int, top_p: float, gen) -> int:
    """The draw before: ``torch.multinomial`` over ``replaced_probs``."""
    return int(torch.multinomial(replaced_probs(row, temperature, top_k, top_p), 1, generator=gen))


def engine_draw(row: torch.Tensor, temperature: float, top_k: int, top_p: float, gen) -> int:
    weights, ids = engine_sampler._candidates(row, temperature, top_k, top_p)
    i = engine_sampler._inverse_cdf(weights, gen)
    return i if ids is None else int(ids[i])


DRAWS = {"torch.multinomial (replaced)": replaced_draw, "engine": engine_draw}


def check_distributions(draws: int = 40000) -> None:
    """Each draw's frequencies over a 12-token row against the exact filtered
    distribution, for every setting; raises when one is off."""
    row = torch.linspace(3.0, -2.0, 12)
    gen = torch.Generator().manual_seed(0)
    for name, kw in SAMPLED.items():
        t, p = kw["temperature"], kw.get("top_p", 1.0)
        # the reference: the whole row's filtered distribution, computed apart from the
        # engine's candidates
        exact = replaced_probs(row.double(), t, 0, p)
        for label, draw in DRAWS.items():
            counts = torch.zeros(12, dtype=torch.float64)
            for _ in range(draws):
                counts[draw(row, t, 0, p, gen)] += 1
            tv = float((counts / draws - exact).abs().sum() / 2)
            if tv > 0.02:
                raise SystemExit(f"{label}, {name}: total variation {tv:.3f} from the exact one")


def per_row(rows: torch.Tensor, repeats: int = 200) -> dict[tuple[str, str], float]:
    """Median microseconds of one draw over the model's own logits rows."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    for name, kw in SAMPLED.items():
        t, p = kw["temperature"], kw.get("top_p", 1.0)
        for label, draw in DRAWS.items():
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                draw(rows[i % len(rows)], t, 0, p, gen)
                times.append(time.perf_counter() - start)
            out[label, name] = statistics.median(times) * 1e6
    return out


def model_rows(llm: LLM) -> torch.Tensor:
    """Logits rows [64, vocab] the model gave while sampling a chat answer."""
    sampler, captured = llm.engine.runner.sampler, []
    sample = sampler.sample

    def keep(logits, requests):
        captured.append(logits.clone())
        return sample(logits, requests)

    sampler.sample = keep
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=0, ignore_eos=True)
    try:
        llm.chat([{"role": "user", "content": "Tell me about the sea."}], params)
    finally:
        del sampler.sample
    return torch.cat(captured)


def decode(llm: LLM, batch: int, steps: int, params: SamplingParams, tag: str) -> float:
    e = llm.engine
    for i in range(batch):
        e.add_request(f"{tag}-{i}", [100 + i + j % 50 for j in range(128)], params)
    while any(r.num_output_tokens == 0 for r in e.requests.values()):
        e.step()
    start, tokens = time.perf_counter(), 0
    while e.has_unfinished_requests():
        tokens += len(e.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(MODEL)
    print(f"{MODEL}, 2 threads, {native.isa() or 'plain torch'} kernels")
    check_distributions()
    print("draws checked: both within 0.02 total variation of the exact distribution")
    costs = per_row(model_rows(llm))
    print("\none draw, median us (the model's own logits rows):")
    for name in SAMPLED:
        old, new = costs["torch.multinomial (replaced)", name], costs["engine", name]
        print(f"  {name:>10}: replaced {old:8.1f}  engine {new:7.1f}  ({old / new:.1f}x)")
    print(f"\ndecode tok/s, 128-token contexts, {args.steps} steps, best of {args.repeats}:")
    for name, kw in SAMPLED.items():
        for batch in (int(b) for b in args.batches.split(",")):
            best = {"greedy": 0.0, "engine": 0.0, "replaced": 0.0}
            for r in range(args.repeats):
                for label in best:
                    how = dict(temperature=0) if label == "greedy" else kw
                    p = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, seed=r, **how)
                    with replaced() if label == "replaced" else contextlib.nullcontext():
                        rate = decode(llm, batch, args.steps, p, f"{name}{batch}{label}{r}")
                    best[label] = max(best[label], rate)
            if max(best["engine"], best["replaced"]) > 1.05 * best["greedy"]:
                raise SystemExit(f"{name} batch {batch}: sampled faster than greedy: {best}")
            print(
                f"  {name:>10} batch {batch:2d}: greedy {best['greedy']:7.1f}  sampled "
                f"{best['engine']:7.1f} ({best['engine'] / best['greedy']:.2f}x greedy)  "
                f"replaced draw {best['replaced']:7.1f}  engine/replaced "
                f"{best['engine'] / best['replaced']:.2f}x"
            )


@contextlib.contextmanager
def replaced():
    """The engine sampler drawing the way it did before: its candidates the whole
    filtered row, its draw ``torch.multinomial``; penalties and seeds as ever."""
    candidates, inverse_cdf = engine_sampler._candidates, engine_sampler._inverse_cdf
    engine_sampler._candidates = lambda row, t, k, p: (replaced_probs(row, t, k, p), None)
    engine_sampler._inverse_cdf = lambda w, gen: int(torch.multinomial(w, 1, generator=gen))
    try:
        yield
    finally:
        engine_sampler._candidates, engine_sampler._inverse_cdf = candidates, inverse_cdf


if __name__ == "__main__":
    main()
