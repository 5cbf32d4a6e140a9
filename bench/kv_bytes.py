"""KV bytes per token per device and per handoff for MHA, GQA, MLA, GTA, GLA-2 and GLA-4
at one model width (DeepSeek-V3's attention dims), beside the formulas of "Hardware-
Efficient Attention for Fast Decoding" (Zadouri, Strauss, Dao; arXiv 2505.21487), then
decode attention time per layout on this CPU (``bench.kv_decode_time``).

    python -m pdserve.bench.kv_bytes [--tp 1,2,4,8] [--tokens 1024] [--measure-mib 256]
        [--time-tp 8] [--threads 1] [--max-cache-mib 1024] [--no-measure] [--no-time]

Where each figure comes from (the ``source`` column; ``paper only`` where the engine
does not shard a layout's latent heads over that degree):
- ``layout``: the cache the engine allocates, ``kv_transfer.layout.KVLayout.cache_shape``
  (``[layers, 2, blocks, block_size, kv_heads / tp, head_dim]``, or for a latent cache
  ``[layers, blocks, block_size, Hc_local * Dc + Dr]``), its bytes over its tokens; the
  handoff sums the routes the transport sends (``kv_transfer.routes.routes``: each
  route's heads or row columns, every part, every block; MLA's row once per decode
  instance: its rank 0 forwards it to the other ranks, off the wire).
The ``paper`` columns are the paper's formulas in its own symbols (``paper_*``), written
independently of both. A second table sends every layout's request through the KV
transport and compares the bytes it reports with the layout's (``bench.kv_measured``).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from pdserve.kv_transfer.layout import DTYPES, KVLayout
from pdserve.kv_transfer.routes import routes
from pdserve.planner.attention import GroupedAttention, LatentAttention
from pdserve.planner.model_shape import ModelShape, get_model

BLOCK_SIZE = 16
DTYPE = "bfloat16"


@dataclass(frozen=True)
class Variant:
    """One attention layout of the model width: a planner preset and the paper's name."""

    name: str
    preset: str

    @property
    def shape(self) -> ModelShape:
        return get_model(self.preset)


VARIANTS = (
    Variant("MHA", "deepseek-v3-dense-mha"),
    Variant("GQA-8", "deepseek-v3-dense-gqa-8"),
    Variant("MLA", "deepseek-v3-dense"),
    Variant("GTA-8", "deepseek-v3-dense-gta-8"),
    Variant("GLA-2", "deepseek-v3-dense-gla-2"),
    Variant("GLA-4", "deepseek-v3-dense-gla-4"),
)


def layout(shape: ModelShape, tp: int, rank: int = 0) -> KVLayout:
    """The engine's cache layout of ``shape`` on rank ``rank`` of ``tp``: per-head K/V, or
    a latent row (MLA's single latent replicated, GLA/GTA heads sharded)."""
    lat = shape.latent
    if lat is None:
        return KVLayout(
            shape.num_layers, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, DTYPE, tp, rank
        )
    return KVLayout(
        shape.num_layers,
        BLOCK_SIZE,
        lat.heads,
        lat.dim,
        DTYPE,
        tp,
        rank,
        "latent",
        lat.rope_dim,
        lat.heads == 1,
    )


def bytes_per_token_per_device(shape: ModelShape, tp: int) -> int:
    """A rank's cache bytes over the tokens it holds (every rank holds the same)."""
    blocks = 4
    dims = layout(shape, tp).cache_shape(blocks)
    return math.prod(dims) * DTYPES[DTYPE] // (blocks * BLOCK_SIZE)


def transfer_bytes(shape: ModelShape, tokens: int, prefill_tp: int, decode_tp: int) -> int:
    """Bytes one request of ``tokens`` tokens moves from a prefill to a decode instance:
    the routes the transport sends (each route's units, every part, every block)."""
    blocks = -(-tokens // BLOCK_SIZE)
    lay = layout(shape, prefill_tp)
    per_block = sum(
        lay.parts * lay.block_bytes(r.num_heads) for r in routes(lay, prefill_tp, decode_tp)
    )
    return shape.num_layers * blocks * per_block


def paper_bytes_per_token_per_device(shape: ModelShape, tp: int) -> float:
    """The paper's per-device KV of a token: m_kv x (h_q / g_q) x D / N heads of d_h
    (m_kv 2 for distinct K and V, 1 tied), the duplication D = ceil(N g_q / h_q); GTA adds
    its d_h/2 RoPE key, MLA and GLA are h_c latent heads of d_c plus d_R; x layers x
    sizeof(dtype)."""
    h_q, n, size = shape.num_heads, tp, shape.dtype_bytes
    att = shape.attention
    if isinstance(att, GroupedAttention):
        heads, width, extra, m_kv = att.num_kv_heads, att.head_dim, 0, 2
    else:
        assert isinstance(att, LatentAttention)
        heads, width, extra, m_kv = att.heads, att.dim, att.rope_dim, 1
    g_q = h_q / heads
    dup = math.ceil(n * g_q / h_q)
    return shape.num_layers * (m_kv * heads * dup / n * width + extra) * size


def paper_transfer_bytes(shape: ModelShape, tokens: int, decode_tp: int) -> float:
    """No formula in the paper for a handoff: N decode devices x its per-device KV x
    tokens (for distinct heads, D = 1, this is the whole cache once), except MLA's
    (h_c = 1, every device holding the whole latent): one device's, sent once (the
    decode instance copies it to its other devices)."""
    att = shape.attention
    copies = 1 if isinstance(att, LatentAttention) and att.heads == 1 else decode_tp
    return copies * paper_bytes_per_token_per_device(shape, decode_tp) * tokens


@dataclass(frozen=True)
class Row:
    """One variant at one degree; ``None``: the engine does not allocate that layout (GLA's
    latent heads fewer than ranks), only the paper's formula (D copies) is shown."""

    variant: str
    tp: int
    per_device: int | None
    per_device_paper: float
    per_device_vs_mha: float | None
    transfer: int | None
    transfer_paper: float
    transfer_vs_mha: float | None
    source: str


def table(tps=(1, 2, 4, 8), tokens: int = 1024, variants=VARIANTS) -> list[Row]:
    """Every variant at every degree; prefill and decode at the same degree."""
    rows = []
    for tp in tps:
        mha = variants[0].shape
        base_dev = bytes_per_token_per_device(mha, tp)
        base_xfer = transfer_bytes(mha, tokens, tp, tp)
        for v in variants:
            s = v.shape
            paper = paper_bytes_per_token_per_device(s, tp), paper_transfer_bytes(s, tokens, tp)
            if not s.attention.supports(tp):
                why = f"paper only: {s.latent.heads} latent heads do not shard over TP {tp}"
                rows.append(Row(v.name, tp, None, paper[0], None, None, paper[1], None, why))
                continue
            dev, xfer = bytes_per_token_per_device(s, tp), transfer_bytes(s, tokens, tp, tp)
            source = "layout"
            rows.append(
                Row(
                    v.name,
                    tp,
                    dev,
                    paper[0],
                    dev / base_dev,
                    xfer,
                    paper[1],
                    xfer / base_xfer,
                    source,
                )
            )
    return rows


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[Row], tokens: int) -> list[str]:
    head = (
        f"| variant | TP | KV B/token/device | paper | vs MHA | sent per {tokens}-token "
        "request (MiB) | formula (MiB) | vs MHA | source |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        sent = None if r.transfer is None else r.transfer / 2**20
        lines.append(
            f"| {r.variant} | {r.tp} | {_cell(r.per_device, ',')} | {r.per_device_paper:,.0f} | "
            f"{_cell(r.per_device_vs_mha, '.4f')} | {_cell(sent, ',.2f')} | "
            f"{r.transfer_paper / 2**20:,.2f} | {_cell(r.transfer_vs_mha, '.4f')} | {r.source} |"
        )
    return lines


def measured_lines(tokens: int, pairs, max_mib: float, variants=VARIANTS) -> list[str]:
    """Handoffs through the transport (``bench.kv_measured``), each beside the layout's
    figure for the layers measured: as many of the model's as fit ``max_mib`` a side."""
    from pdserve.bench.kv_measured import measure_handoff

    lines = [
        f"measured: one {tokens}-token request over the grpc transport (loopback, this "
        f"process), at most {max_mib:g} MiB of cache a side",
        "| variant | prefill TP -> decode TP | layers | sent (B) | landed (B) | layout (B) "
        "| equal |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for v in variants:
        s = v.shape
        per_layer = transfer_bytes(replace(s, num_layers=1), tokens, 1, 1)
        layers = max(1, min(s.num_layers, int(max_mib * 2**20 // per_layer)))
        want_shape = replace(s, num_layers=layers)
        for p, d in pairs:
            if not (s.attention.supports(p) and s.attention.supports(d)):
                lines.append(f"| {v.name} | {p} -> {d} | - | - | - | - | not sharded so |")
                continue
            m = measure_handoff(s, tokens, p, d, layers, BLOCK_SIZE)
            want = transfer_bytes(want_shape, tokens, p, d)
            ok = "yes" if m.sent == m.landed == want else "NO"
            cells = f"{m.sent:,} | {m.landed:,} | {want:,} | {ok}"
            lines.append(f"| {v.name} | {p} -> {d} | {layers} | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_bytes", description=__doc__)
    p.add_argument("--tp", default="1,2,4,8", help="tensor-parallel degrees")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the request handed off")
    p.add_argument("--time-tp", type=int, default=8, help="the rank's share timed (per-rank heads)")
    p.add_argument("--max-cache-mib", type=int, default=1024, help="skip larger timed caches")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the timed part")
    p.add_argument("--measure-mib", type=float, default=256, help="cache a side, measured")
    p.add_argument("--no-measure", action="store_true", help="no handoff through the transport")
    p.add_argument("--no-time", action="store_true", help="no decode attention timing")
    args = p.parse_args(argv)
    tps = tuple(int(t) for t in args.tp.split(","))
    first = VARIANTS[0].shape
    print(
        f"{first.num_layers} layers, {first.num_heads} query heads, {DTYPE}, block_size "
        f"{BLOCK_SIZE}; prefill TP = decode TP"
    )
    print("\n".join(format_table(table(tps, args.tokens), args.tokens)))
    if not args.no_measure:
        pairs = [(t, t) for t in tps] + [(1, max(tps))]
        print()
        print("\n".join(measured_lines(args.tokens, pairs, args.measure_mib)))
    if not args.no_time:
        from pdserve.bench.kv_decode_time import report

        print()
        print("\n".join(report(VARIANTS, args.time_tp, args.max_cache_mib, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
