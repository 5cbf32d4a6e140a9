"""Text <-> token ids and the chat template, from a HF folder or a GGUF file's metadata."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp): 3 control, 4 user-defined; both are matched whole.
_SPECIAL_TYPES = (3, 4)


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        add_bos: bool = False,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template = None
        self._added: set[int] | None = None  # ids of added tokens, read on first use

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, added tokens included, in characters: a token
        stands for at most this many characters of a text (a byte-level entry spells
        its bytes, one character each; a byte-fallback entry ``<0x41>`` is longer than
        its byte), so a text of C characters is at least C / max_token_chars tokens."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, for logprobs: a byte-level BPE token's exact
        bytes (it may hold part of a UTF-8 character); an added (special) token's text;
        otherwise the token decoded alone. Empty for an id outside the vocabulary."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if self._added is None:
            self._added = set(self.backend.get_added_tokens_decoder())
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        if byte_level and token_id not in self._added and all(c in _BYTE_OF_CHAR for c in token):
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The template rendered over ``messages`` (and ``tools``, OpenAI's function
        objects, for a template that reads them: ``takes_tools``)."""
        if not self.chat_template:
            raise ValueError("messages: this model has no chat template; send a plain prompt")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        bos = self._token(self.bos_token_id)
        eos = self._token(self.eos_token_ids[0] if self.eos_token_ids else None)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **({"tools": tools} if tools else {}),
        )

    @property
    def takes_tools(self) -> bool:
        """The chat template reads ``tools`` (HF's convention for tool calling)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id)

    def save(self, folder: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json as a HF folder holds them."""
        self.backend.save(str(folder / "tokenizer.json"))
        meta = {
            "bos_token": None if self.bos_token_id is None else self._token(self.bos_token_id),
            "eos_token": self._token(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "chat_template": self.chat_template,
            "add_bos_token": self.add_bos,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer | None:
        """From a HF folder; None when the folder has no tokenizer.json."""
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        backend = HFTokenizer.from_file(str(path))
        meta_path = folder / "tokenizer_config.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}

        def token_id(entry) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return None if entry is None else backend.token_to_id(entry)

        bos = token_id(meta.get("bos_token"))
        eos = token_id(meta.get("eos_token"))
        if eos is not None and eos not in eos_token_ids:
            eos_token_ids = (eos, *eos_token_ids)
        template = meta.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(backend, bos, eos_token_ids, template, bool(meta.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """From the ``tokenizer.ggml.*`` metadata of a GGUF file (byte-level BPE models)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is supported"
            )
        tokens = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        for a, b in merges:
            if a not in vocab or b not in vocab or a + b not in vocab:
                raise ValueError(
                    f"tokenizer.ggml.merges: {a!r} + {b!r} names a token missing from "
                    "tokenizer.ggml.tokens"
                )
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if fields.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "command-r"):
            # llama.cpp splits these vocabularies' digits one by one before the GPT-2 regex.
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type", [])
        special = [tokens[i] for i, t in enumerate(types) if t in _SPECIAL_TYPES]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            fields.get("tokenizer.ggml.bos_token_id"),
            () if eos is None else (int(eos),),
            fields.get("tokenizer.chat_template"),
            bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``pre_tokenizers.ByteLevel``): the character that
    stands for each byte -> that byte. Printable bytes stand for themselves, the others
    for chr(256 + n), n counting them in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _raise(message: str):
    raise ValueError(f"chat template: {message}")
