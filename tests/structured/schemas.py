"""Fifty varied Pydantic models for structured-output tests: nested objects, enums,
arrays, strings, numbers (bounded, as a schema for a small model should be: unbounded, a 135M
model's greedy output may repeat until max_tokens), optional fields, numbers,
booleans, literals. Built from a seed, the same every run."""

from __future__ import annotations

import enum
import random
from typing import Literal

from pydantic import BaseModel, Field, conint, conlist, constr, create_model


class Color(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: int = Field(ge=0, le=99999)


class Pet(BaseModel):
    name: str = Field(max_length=16)
    kind: Literal["cat", "dog", "bird"]


_FIELDS = [
    ("name", (str, Field(max_length=24))),
    ("age", (int, Field(ge=0, le=150))),
    ("height_m", (float, Field(ge=0, le=3))),
    ("active", (bool, ...)),
    ("color", (Color, ...)),
    ("address", (Address, ...)),
    ("tags", (conlist(constr(max_length=16), max_length=3), ...)),
    ("scores", (conlist(conint(ge=0, le=100), min_length=1, max_length=4), ...)),
    ("pet", (Pet | None, None)),
    ("nickname", (str | None, Field(default=None, max_length=16))),
    ("pets", (conlist(Pet, max_length=2), ...)),
    ("level", (Literal["low", "mid", "high"], ...)),
]

PROMPTS = [
    "Describe a fictional person.",
    "Make up a record for a customer.",
    "Invent a character for a story.",
    "Give an example entry for a database.",
]


def models(n: int = 50, seed: int = 7) -> list[type[BaseModel]]:
    """``n`` models of 1-5 fields each, drawn from ``_FIELDS``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chosen = rng.sample(_FIELDS, rng.randint(1, 5))
        out.append(create_model(f"Thing{i}", **dict(chosen)))
    return out
