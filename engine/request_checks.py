"""What a request must be for an engine to take it (``add_request`` and ``reserve``):
each check raises ValueError naming the key, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.engine.sampling_params import SamplingParams


def check_prompt(
    ids: list[int],
    delivered: tuple[int, ...],
    max_context: int,
    num_blocks: int,
    block_size: int,
    vocab_size: int,
) -> None:
    """A prompt (and a resumed request's ``delivered`` output) that can run in an engine
    of ``max_context`` positions and ``num_blocks`` KV blocks of ``block_size`` tokens: in
    the vocabulary, leaving room in the context and the cache for one more token."""
    if not ids:
        raise ValueError("prompt: empty; give at least one token")
    what = "prompt" if not delivered else f"prompt + delivered ({len(delivered)})"
    total = len(ids) + len(delivered)
    if total >= max_context:
        raise ValueError(
            f"{what}: {total} tokens, the context holds {max_context} "
            "(they must leave room for one generated token)"
        )
    if -(-(total + 1) // block_size) > num_blocks:
        raise ValueError(
            f"{what}: {total} tokens need more than the {num_blocks} "
            f"KV blocks of {block_size} tokens this engine has"
        )
    for key, values in (("prompt", ids), ("delivered", delivered)):
        if values and (min(values) < 0 or max(values) >= vocab_size):
            raise ValueError(f"{key}: token ids must be in [0, {vocab_size})")


def check_delivered(
    delivered: tuple[int, ...], params: SamplingParams, eos_token_ids: Collection[int]
) -> None:
    """A resumed request has output left to generate: fewer delivered tokens than
    ``max_tokens``, none of them one that ends the request."""
    if len(delivered) >= params.max_tokens:
        raise ValueError(
            f"delivered: {len(delivered)} tokens, max_tokens={params.max_tokens}; "
            "a resumed request must have fewer (it would already have finished)"
        )
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= set(eos_token_ids)
    ended = next((t for t in delivered if t in stops), None)
    if ended is not None:
        raise ValueError(
            f"delivered: holds token {ended}, which stops this request (stop_token_ids "
            "or EOS); a request that stopped cannot be resumed"
        )
