"""YAML (plus ``--set key.sub=value`` overrides) into a checked ``ClusterConfig``.

Every failure is a ``ConfigError`` naming the dotted key, the value and what is
allowed, raised before anything starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import typing
from pathlib import Path
from types import NoneType, UnionType

import yaml

from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.cluster.placement_groups import check_placement
from pdserve.cluster.security_checks import check_kv, check_ray, check_router


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


def load_config(
    source: str | Path | dict | ClusterConfig, overrides: typing.Sequence[str] = ()
) -> ClusterConfig:
    """A checked config from a YAML path, a dict or a config, with overrides applied."""
    if isinstance(source, ClusterConfig):
        source = source.to_dict()
    raw = copy.deepcopy(source) if isinstance(source, dict) else _read_yaml(Path(source))
    for item in overrides:
        apply_override(raw, item)
    config = build(ClusterConfig, raw, "")
    check_config(config)
    return config


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError("", f"cannot read the config file {str(path)!r}: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path} is not valid YAML: {e}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: the top level must be a mapping of keys, got {_kind(raw)}")
    return raw


def apply_override(raw: dict, item: str) -> None:
    """``key.sub=value`` with ``value`` read as YAML (``null``, ``true``, ``3``, ``0.5``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", f"--set {item!r}: expected key.sub=value")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"--set value {text!r} is not valid YAML: {e}") from e
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(where, "is not a section; cannot set a sub-key")
        node = child
    node[parts[-1]] = value


def build(cls, raw, path: str):
    """A dataclass instance from a mapping, checking keys, types and values."""
    if not isinstance(raw, dict):
        raise ConfigError(path, f"{_show(raw)} must be a mapping of keys ({_keys(cls)})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(where, f"unknown key; allowed keys here are {_keys(cls)}")
    values = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in raw:
            if name in getattr(cls, "REQUIRED", ()):
                raise ConfigError(where, f"missing; required ({f.metadata.get('help', '')})")
            continue
        values[name] = _convert(hints[name], raw[name], where, f)
    return cls(**values)


def _convert(hint, value, where: str, f: dataclasses.Field):
    if dataclasses.is_dataclass(hint):
        base = f.default_factory() if f.default_factory is not dataclasses.MISSING else hint()
        merged = {**dataclasses.asdict(base), **value} if isinstance(value, dict) else value
        return build(hint, merged, where)
    convert = _mapping if typing.get_origin(hint) is dict else _scalar
    value = convert(hint, value, where)
    check = f.metadata.get("check")
    problem = check(value) if check and value is not None else None
    if problem:
        raise ConfigError(where, f"{_show(value)} is not allowed; {problem}")
    return value


def _mapping(hint, value, where: str) -> dict:
    """A ``dict[str, V]`` key: a mapping of string keys, each value checked as a ``V``."""
    key_kind, kind = typing.get_args(hint)
    if not isinstance(value, dict):
        expected = f"expected a mapping of {_allowed((key_kind,))} to {_allowed((kind,))}"
        raise ConfigError(where, f"{_show(value)} is a {_kind(value)}; {expected}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{where}.{key}", f"the key is a {_kind(key)}; expected a string")
    return {key: _scalar(kind, item, f"{where}.{key}") for key, item in value.items()}


def _scalar(hint, value, where: str):
    """``value`` as the type ``hint`` (``X`` or ``X | None``) names; an int is a fine float."""
    options = typing.get_args(hint) if isinstance(hint, UnionType) else (hint,)
    if value is None:
        if NoneType in options:
            return None
        raise ConfigError(where, f"null is not allowed; {_expect(options)}")
    kind = next((t for t in options if t is not NoneType), None)
    ok = (
        (kind is bool and isinstance(value, bool))
        or (kind is int and isinstance(value, int) and not isinstance(value, bool))
        or (kind is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (kind is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(where, f"{_show(value)} is a {_kind(value)}; {_expect(options)}")
    return float(value) if kind is float else value


def check_config(config: ClusterConfig) -> None:
    """Checks across keys: the pools this mode runs, security (cluster/security_checks.py),
    the model, the machine's CPUs."""
    for role, pool in config.pools().items():
        if role == "prefill" and config.mode == "hybrid" and pool.instances == 0:
            check_peers(config)
        elif pool.instances < 1:
            raise ConfigError(
                f"{role}.instances",
                f"{pool.instances} is not allowed; mode {config.mode} runs the {role} pool, "
                "which needs at least 1 instance",
            )
    if config.mode in ("disaggregated", "hybrid"):
        check_kv_transfer(config)
    for key, problem in (
        check_router(config) + check_kv(config) + check_ray(config.ray) + check_placement(config)
    ):
        raise ConfigError(key, problem)
    folder = model_folder_if_cheap(config.model)
    if folder is not None:
        check_model_shape(config, folder)
    if config.ray.address is None:
        check_local_resources(config)


def check_peers(config: ClusterConfig) -> None:
    """Hybrid mode without a prefill pool: the decode instances prefill for each other
    (docs/serving.md, "Hybrid mode"), so there are two at least, of one rank each."""
    decode = config.decode
    if decode.instances < 2:
        raise ConfigError(
            "decode.instances",
            f"{decode.instances} is not allowed with prefill.instances=0 in mode hybrid: the "
            "decode instances prefill for each other, so at least 2 are needed",
        )
    if decode.tensor_parallel != 1:
        raise ConfigError(
            "decode.tensor_parallel",
            f"{decode.tensor_parallel} is not allowed with prefill.instances=0 in mode "
            "hybrid: a decode instance prefills for a peer at tensor_parallel 1 only",
        )


def check_kv_transfer(config: ClusterConfig) -> None:
    """The pools must be able to exchange KV blocks over the chosen backend."""
    prefill, decode = config.prefill, config.decode
    if prefill.instances and decode.block_size != prefill.block_size:
        raise ConfigError(
            "decode.block_size",
            f"{decode.block_size} differs from prefill.block_size={prefill.block_size}; KV "
            "blocks move between the pools as they are, so both must use the same size",
        )
    backend = config.kv_transfer.backend
    for role, pool in (("prefill", prefill), ("decode", decode)):
        if not pool.instances:
            continue
        gpu = pool.resources.num_gpus > 0
        if backend == "nccl" and not gpu:
            raise ConfigError(
                "kv_transfer.backend",
                f"'nccl' moves GPU memory but {role}.resources.num_gpus is 0; "
                "use gloo or grpc for CPU pools",
            )
        if backend == "gloo" and gpu:
            raise ConfigError(
                "kv_transfer.backend",
                f"'gloo' moves CPU memory but the {role} pool runs on GPUs; use nccl or grpc",
            )


def model_folder_if_cheap(model: str) -> Path | None:
    """The model's HF folder when finding it costs no conversion; checks the model exists."""
    from pdserve.engine.checkpoint import ALIASES, alias_path

    if model in ALIASES:
        try:
            path = alias_path(model)
        except ValueError as e:
            raise ConfigError("model", str(e).removeprefix("model=")) from e
        if not path.exists():
            raise ConfigError("model", f"{model!r}: the alias file {path} is missing")
        return None
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return None
    raise ConfigError(
        "model",
        f"{model!r} not found; allowed: an alias ({', '.join(ALIASES)}), a HF folder with "
        "config.json and *.safetensors, or a .gguf file",
    )


def check_model_shape(config: ClusterConfig, folder: Path) -> None:
    """The model's family must be one the engine serves (engine/families.py), and its
    attention heads and KV heads must split evenly over each pool's tensor_parallel."""
    from pdserve.engine.families import check_family

    hf = json.loads((folder / "config.json").read_text())
    try:
        check_family(hf)
    except ValueError as e:
        raise ConfigError("model", f"{str(folder)!r}: {e}") from e
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    inter = hf.get("intermediate_size") or kv_heads
    if not isinstance(heads, int):
        return
    for role, pool in config.pools().items():
        tp = pool.tensor_parallel
        if heads % tp or kv_heads % tp or inter % tp:
            fits = [
                d for d in range(1, kv_heads + 1) if not (heads % d or kv_heads % d or inter % d)
            ]
            raise ConfigError(
                f"{role}.tensor_parallel",
                f"{tp} is not allowed; it must divide the model's {heads} attention heads, "
                f"{kv_heads} KV heads and MLP width {inter} (allowed: {', '.join(map(str, fits))})",
            )


def check_local_resources(config: ClusterConfig) -> None:
    """An embedded Ray offers this machine's CPUs and GPUs; the pools must fit in them."""
    cpus = config.ray.num_cpus or os.cpu_count() or 1
    source = "ray.num_cpus" if config.ray.num_cpus else "this machine's CPU count"
    need = sum(_total(p, "num_cpus") for p in config.pools().values())
    if need > cpus + 1e-9:
        parts = " + ".join(_explain(r, p, "num_cpus") for r, p in config.pools().items())
        raise ConfigError(
            _biggest(config, "num_cpus"),
            f"the pools ask for {parts} = {need:g} CPUs, but the embedded local Ray "
            f"(ray.address null) has {cpus:g} ({source}); allowed: at most {cpus:g} in total",
        )
    gpus_needed = sum(_total(p, "num_gpus") for p in config.pools().values())
    if gpus_needed > 0:
        import torch

        gpus = torch.cuda.device_count()
        if gpus_needed > gpus:
            raise ConfigError(
                _biggest(config, "num_gpus"),
                f"the pools ask for {gpus_needed:g} GPUs, this machine has {gpus}; "
                f"allowed: at most {gpus} in total",
            )


def _total(pool: PoolConfig, resource: str) -> float:
    return pool.instances * pool.tensor_parallel * getattr(pool.resources, resource)


def _explain(role: str, pool: PoolConfig, resource: str) -> str:
    each = getattr(pool.resources, resource)
    return f"{role} {pool.instances} instances x {pool.tensor_parallel} tp x {each:g}"


def _biggest(config: ClusterConfig, resource: str) -> str:
    role = max(config.pools(), key=lambda r: _total(config.pools()[r], resource))
    return f"{role}.resources.{resource}"


def _keys(cls) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _expect(options) -> str:
    return "expected " + _allowed(options)


def _allowed(options) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    allowed = [names.get(t, getattr(t, "__name__", str(t))) for t in options if t is not NoneType]
    if NoneType in options:
        allowed.append("null")
    return " or ".join(allowed)


def _kind(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(value), "mapping" if isinstance(value, dict) else type(value).__name__
    )


def _show(value) -> str:
    return repr(value) if not isinstance(value, dict | list) else json.dumps(value)
