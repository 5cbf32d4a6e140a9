"""Step times from first principles (Pope et al. 2022, "Efficiently Scaling Transformer
Inference"): a step takes max(compute, memory) plus its communication.

- compute: 2 FLOPs per weight per token, plus attention (QK^T and AV): 2 x heads x
  head_dim FLOPs per (query, key) pair per layer and matmul; a causal prompt of L tokens
  has L^2/2 pairs, so the prompts' attention is 2 x layers x heads x head_dim x sum L^2.
  Latent attention (``planner.attention``): prompts in the expanded form (keys of
  qk_nope + rope, values of v_head_dim), decodes in the absorbed form (every query head
  scores its latent head's first Dk dims and the RoPE key, and sums the Dc-wide rows).
- memory: every weight once per step, plus the KV the step reads (decode: the whole
  context) and writes (the new tokens), as every rank holds it: MLA's latent is read
  by each rank whole, so its per-rank KV bytes do not shrink with tp.
- communication: with tensor parallelism t, two all-reduces per layer of [tokens,
  hidden] (after attention's output projection and after the MLP), a ring moving
  2 (t-1)/t of the data per device.

Every cost model (this one, ``planner.fitted.FittedCost``) answers the same calls:
``prefill_s``, ``decode_s``, ``mixed_s`` (a co-located step: prompt chunks beside
decodes), ``transfer_s``, ``transfer_bytes`` (a handoff's bytes to a decode instance of
a given degree), ``kv_bytes_per_token``, ``kv_capacity_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.hardware import Hardware
from pdserve.planner.model_shape import ModelShape


@dataclass(frozen=True)
class RooflineCost:
    model: ModelShape
    hw: Hardware

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def _prefill_flops_per_pair(self) -> float:
        m = self.model
        return m.num_layers * m.attention.prefill_flops_per_pair(m.num_heads)

    def _decode_flops_per_pair(self) -> float:
        m = self.model
        return m.num_layers * m.attention.decode_flops_per_pair(m.num_heads)

    def _step(self, tokens: int, flops: float, nbytes: float, tp: int) -> float:
        hw = self.hw
        compute = flops / (tp * hw.peak_flops * hw.compute_eff)
        memory = nbytes / (tp * hw.mem_bandwidth * hw.mem_eff)
        return max(compute, memory) + self.allreduce_s(tokens, tp)

    def allreduce_s(self, tokens: int, tp: int) -> float:
        """Two ring all-reduces per layer of [tokens, hidden]."""
        if tp == 1 or tokens == 0:
            return 0.0
        m, hw = self.model, self.hw
        size = tokens * m.hidden_size * m.dtype_bytes
        one = 2 * (tp - 1) / tp * size / hw.tp_bandwidth + hw.tp_latency_s
        return 2 * m.num_layers * one

    def prefill_s(self, tokens: int, sum_sq: float, tp: int = 1, seqs: int = 1) -> float:
        """One step of ``tokens`` prompt tokens whose attention covers ``sum_sq`` (query,
        key) pairs times two (sum of squared prompt lengths for whole prompts)."""
        if tokens <= 0:
            return 0.0
        m = self.model
        flops = 2 * m.params * tokens + self._prefill_flops_per_pair() * sum_sq / 2
        nbytes = m.weight_bytes + tokens * m.kv_bytes_per_instance(tp)
        return self._step(tokens, flops, nbytes, tp)

    def decode_s(self, batch: int, context: int, tp: int = 1) -> float:
        """One step of ``batch`` sequences holding ``context`` tokens of KV in all."""
        if batch <= 0:
            return 0.0
        m = self.model
        flops = 2 * m.params * batch + self._decode_flops_per_pair() * context
        nbytes = m.weight_bytes + (context + batch) * m.kv_bytes_per_instance(tp)
        return self._step(batch, flops, nbytes, tp)

    def mixed_s(self, tokens: int, sum_sq: float, batch: int, context: int, tp: int = 1) -> float:
        """Prompt chunks and decodes in one pass: the FLOPs add up, the weights are read
        once."""
        if tokens <= 0 or batch <= 0:
            return self.prefill_s(tokens, sum_sq, tp) + self.decode_s(batch, context, tp)
        m = self.model
        flops = 2 * m.params * (tokens + batch)
        flops += self._prefill_flops_per_pair() * sum_sq / 2
        flops += self._decode_flops_per_pair() * context
        nbytes = m.weight_bytes + (tokens + context + batch) * m.kv_bytes_per_instance(tp)
        return self._step(tokens + batch, flops, nbytes, tp)

    def transfer_s(self, nbytes: float) -> float:
        return nbytes / self.hw.kv_bandwidth + self.hw.kv_latency_s if nbytes > 0 else 0.0

    def transfer_bytes(self, tokens: int, decode_tp: int) -> int:
        """What a handoff of ``tokens`` tokens moves to a decode instance of ``decode_tp``."""
        return self.model.kv_transfer_bytes(tokens, decode_tp)

    def kv_capacity_tokens(self, tp: int) -> int:
        """KV tokens an instance of ``tp`` devices holds next to its weights (0: the
        weights alone do not fit)."""
        free = tp * self.hw.mem_bytes * self.hw.mem_util - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_instance(tp)))
