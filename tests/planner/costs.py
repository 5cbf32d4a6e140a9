"""A cost model whose step times are easy to compute by hand."""

from dataclasses import dataclass


@dataclass
class LinearCost:
    prefill_base: float = 0.01  # s per prefill step
    prefill_per_token: float = 0.001  # s per prompt token
    decode_base: float = 0.02  # s per decode step
    decode_per_seq: float = 0.0
    transfer: float = 0.0  # s per KV transfer
    kv_bytes_per_token: int = 1000
    capacity_tokens: int = 1 << 20

    def prefill_s(self, tokens, sum_sq, tp=1):
        return self.prefill_base + self.prefill_per_token * tokens if tokens else 0.0

    def decode_s(self, batch, context, tp=1):
        return self.decode_base + self.decode_per_seq * batch if batch else 0.0

    def mixed_s(self, tokens, sum_sq, batch, context, tp=1):
        return self.prefill_s(tokens, sum_sq, tp) + self.decode_s(batch, context, tp)

    def transfer_s(self, nbytes):
        return self.transfer

    def transfer_bytes(self, tokens, decode_tp):
        return tokens * self.kv_bytes_per_token

    def kv_capacity_tokens(self, tp):
        return self.capacity_tokens
