"""The ``pdserve`` command."""

from __future__ import annotations

import argparse
import sys
import time


def _generate_offline(args: argparse.Namespace) -> int:
    from engine import EngineConfig, LLMEngine, SamplingParams

    started = time.monotonic()
    engine = LLMEngine(args.model, EngineConfig(dtype=args.dtype))
    loaded = time.monotonic()
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    request = engine.add_request("cli-0", prompt, params)
    first_token_at = None
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_at = first_token_at or time.monotonic()
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            reason = out.finish_reason
    end = time.monotonic()
    n = request.num_output_tokens
    tpot = (end - first_token_at) / (n - 1) * 1000 if n > 1 else 0.0
    print(
        f"\n[{args.model}: load {loaded - started:.1f} s, "
        f"prompt {request.num_prompt_tokens} tokens, "
        f"TTFT {(first_token_at - loaded) * 1000:.0f} ms, {n} tokens, TPOT {tpot:.1f} ms, "
        f"finish {reason}]"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--offline", action="store_true", help="run the engine in this process")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.command == "generate":
        if not args.offline:
            parser.error("generate: only --offline is available until the cluster lands")
        try:
            return _generate_offline(args)
        except ValueError as e:
            parser.error(str(e))
    return 2


if __name__ == "__main__":
    sys.exit(main())
