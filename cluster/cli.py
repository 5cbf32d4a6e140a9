"""The ``pdserve`` command.

pdserve up CONFIG [--set key.sub=value ...] [--demo PROMPT]   serve until Ctrl-C / SIGTERM
pdserve generate "prompt" [--chat] [--max-tokens N] [--temperature T] [--router ADDR]
                 [--api-key KEY] [--ca-file CA.pem]              a router with keys / TLS
pdserve generate --offline "prompt" ...                        the engine in this process
pdserve stats [--router ADDR] [--api-key KEY] [--ca-file CA.pem]  queue and per-instance load
pdserve bench CONFIG [--workload W] [--rates R1,R2] [--search]  goodput under SLOs
pdserve bench --endpoint URL --model M ...                     of an OpenAI-compatible server
pdserve compare A.yaml B.yaml [...] [--rates ...] --out DIR    the same requests, side by side
pdserve chaos CONFIG [--kill-every S] [--role R] [--signal KILL|STOP]  load while killing
pdserve profile CONFIG [--out profile.json]                    step and KV transfer times here
pdserve profile --served A.yaml [B.yaml] [--rate R]            ... as the clusters serve them
pdserve plan --model M --devices N --workload W ...            placement search, writes a YAML
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from pdserve.cluster.cli_router import (
    DEFAULT_CA_FILE,
    DEFAULT_ROUTER,
    client_arguments,
    show_stats,
    stream_to_terminal,
)


def _generate_offline(args: argparse.Namespace) -> int:
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

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


def _up(args: argparse.Namespace) -> int:
    from pdserve.cluster.config_loader import ConfigError, load_config
    from pdserve.cluster.launcher import launch

    try:
        config = load_config(args.config, args.set or [])
    except ConfigError as e:
        print(f"pdserve up: {args.config}: {e}", file=sys.stderr)
        return 2
    from pdserve.router.request_log import configure

    configure(config.logging.format, config.logging.level)
    pools = ", ".join(f"{p.instances} {role}" for role, p in config.pools().items())
    print(f"pdserve: starting {pools} instances of {config.model} on Ray ...", flush=True)
    started = time.monotonic()
    try:
        cluster = launch(config)
    except ConfigError as e:
        print(f"pdserve up: {args.config}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # launch stopped whatever it had started
        print(f"pdserve up: could not start the cluster: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():  # a second Ctrl-C: stop without waiting
            raise KeyboardInterrupt
        stop.set()

    # after launch: ray.init installs a SIGTERM handler of its own
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    scheme = "https" if config.router.tls.cert_file else "http"
    try:
        replicas = len(cluster.routers)
        who = f"{replicas} replicas" if replicas > 1 else f"pid {cluster.router_pid()}"
        print(
            f"pdserve: router listening on {cluster.address} ({who}, "
            f"policy {config.router.policy}, ready in {time.monotonic() - started:.1f} s), "
            f"OpenAI-compatible HTTP on {scheme}://{cluster.http_address}/v1; Ctrl-C to stop",
            flush=True,
        )
        if args.demo:
            print(f"> {args.demo}", flush=True)
            stream_to_terminal(
                cluster.address,
                args.demo,
                chat=True,
                api_key=_first_key(config),
                ca_file=args.ca_file,
                max_tokens=args.max_tokens,
                temperature=0.0,
            )
            print(f"pdserve: serving on {cluster.address}; Ctrl-C to stop", flush=True)
        # serving until Ctrl-C / SIGTERM: a router replica that dies or hangs is restarted
        # on the same ports by its keeper (cluster/keeper.py)
        while not stop.wait(0.5):  # short waits: the signal handler runs between them
            pass
        print("pdserve: draining in-flight requests ...", flush=True)
        cut = cluster.drain()
        if cut:
            print(f"pdserve: {cut} requests cut at router.drain_timeout_s", flush=True)
    except KeyboardInterrupt:
        print("pdserve: stopping now", flush=True)
    finally:
        cluster.shutdown(drain=False)
    print("pdserve: stopped", flush=True)
    return 0


def _first_key(config) -> str | None:
    """A key of ``router.api_key_file`` for ``--demo`` (None: the router has none)."""
    from pdserve.router.auth import read_key_file

    path = config.router.api_key_file
    return read_key_file(path)[0] if path else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="launch a cluster from a YAML config and serve")
    up.add_argument("config", help="YAML file (configs/local-colocated.yaml)")
    up.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    up.add_argument("--demo", metavar="PROMPT", help="once up, send this chat prompt and print")
    up.add_argument("--max-tokens", type=int, default=64, help="for --demo")
    up.add_argument("--ca-file", default=DEFAULT_CA_FILE, help="for --demo with router.tls")

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--offline", action="store_true", help="run the engine in this process")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--router", default=DEFAULT_ROUTER, help="router address (host:port)")
    gen.add_argument("--model", default="smollm2-135m", help="with --offline")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    client_arguments(gen)

    stats = sub.add_parser("stats", help="the router's queue and each instance's load")
    stats.add_argument("--router", default=DEFAULT_ROUTER, help="router address (host:port)")
    client_arguments(stats)

    from pdserve.loadgen.runner import add_arguments

    bench = sub.add_parser("bench", help="goodput under SLOs: a workload at several rates")
    add_arguments(bench)

    from pdserve.loadgen.compare import add_arguments as add_compare_arguments

    compare = sub.add_parser("compare", help="several configs on the same requests: a report")
    add_compare_arguments(compare)

    from pdserve.loadgen.chaos import add_arguments as add_chaos_arguments

    chaos = sub.add_parser("chaos", help="a ShareGPT load while engine processes are killed")
    add_chaos_arguments(chaos)

    from pdserve.planner.plan import add_arguments as add_plan_arguments
    from pdserve.planner.profile import add_arguments as add_profile_arguments

    profile = sub.add_parser("profile", help="measure this machine's step and KV transfer times")
    add_profile_arguments(profile)
    plan = sub.add_parser("plan", help="search the placement, write a config that up accepts")
    add_plan_arguments(plan)

    args = parser.parse_args(argv)
    if args.command in ("plan", "profile"):
        from pdserve.planner import plan as plan_module
        from pdserve.planner import profile as profile_module

        return (plan_module if args.command == "plan" else profile_module).main(args)
    if args.command == "bench":
        from pdserve.loadgen.runner import main as bench_main

        return bench_main(args)
    if args.command == "compare":
        from pdserve.loadgen.compare import main as compare_main

        return compare_main(args)
    if args.command == "chaos":
        from pdserve.loadgen.chaos import main as chaos_main

        return chaos_main(args)
    if args.command == "up":
        return _up(args)
    if args.command == "stats":
        return show_stats(args)
    if args.offline:
        try:
            return _generate_offline(args)
        except ValueError as e:
            parser.error(str(e))
    return stream_to_terminal(
        args.router,
        args.prompt,
        args.chat,
        api_key=args.api_key,
        ca_file=args.ca_file,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )


if __name__ == "__main__":
    sys.exit(main())
