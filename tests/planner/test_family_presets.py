"""The planner's presets of the families beside Llama: taken by name, their parameter
counts the published ones (model cards; Gemma ties its embedding to the LM head, Gemma 3
12B's count is its text decoder's), and their heads split as the engine splits them."""

import pytest

from pdserve.planner.model_shape import get_model

# name -> (billions of parameters as published, embedding tied to the LM head)
PUBLISHED = {
    "qwen2.5-7b": (7.61, False),
    "qwen3-8b": (8.19, False),
    "mistral-7b": (7.24, False),
    "gemma-2-9b": (9.24, True),
    "gemma-3-12b": (11.77, True),
    "phi-3-mini": (3.82, False),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_family_presets_have_their_published_size(name):
    shape = get_model(name.upper())
    billions, tied = PUBLISHED[name]
    embedding = 0 if tied else shape.vocab_size * shape.hidden_size
    assert (shape.params + embedding) / 1e9 == pytest.approx(billions, rel=0.01)
    assert shape.num_heads % shape.num_kv_heads == 0 and 2 in shape.tp_degrees()
    assert shape.dtype_bytes == 2
