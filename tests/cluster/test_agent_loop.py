"""A real agent framework, pydantic-ai (its ``OpenAIChatModel`` over the official
``openai`` client), runs a two-tool agent loop against ``pdserve up`` on the embedded
model, co-located and disaggregated, to completion: each tool is called, its result is
fed back as a ``role: tool`` message, and the final answer comes through pydantic-ai's
output tool and validates as the Pydantic output type.

Why the loop is steered: the 135M model does not choose tools by itself. Offered the two
tools and the output tool with ``tool_choice: required`` (what pydantic-ai sends when only
a structured output may end the run), it calls the output tool at once, with a made-up
temperature and no tool call before it. So each step names the one tool the loop needs
next through pydantic-ai's documented per-step ``tool_choice`` (a callable
``model_settings``, ``list[str]`` of one name): pydantic-ai sends it as a named function
``tool_choice``, with all three tools in every request, and the server's grammar makes the
model call that tool with arguments that fit its schema. Everything else (the prompt,
the tool definitions with ``strict``, the history with the calls and their results, the
parsing of the calls, the validation of the output) is pydantic-ai's and pdserve's own."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, RunContext, ToolOutput
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from pdserve.bench import structured_api
from tests.router.pdserve_up import pdserve_up

STEPS = ("get_weather", "convert_temperature", "final_answer")  # the loop's order
MAX_TOKENS = 128  # a call here is 30-40 tokens


class Forecast(BaseModel):
    city: str = Field(max_length=24)
    fahrenheit: float


def weather_agent(base_url: str, calls: list, bodies: list) -> tuple[Agent, httpx2.AsyncClient]:
    """The agent: two function tools that record their calls in ``calls``, a ``Forecast``
    output tool, each chat completions request body kept in ``bodies``."""

    async def keep(request: httpx2.Request) -> None:
        bodies.append(json.loads(request.content))

    http = httpx2.AsyncClient(event_hooks={"request": [keep]}, timeout=120)
    provider = OpenAIProvider(base_url=base_url, api_key="unused", http_client=http)

    def settings(ctx: RunContext) -> dict:
        """Greedy, bounded, and the next tool of ``STEPS`` whose result is not back yet."""
        returned = {
            p.tool_name
            for m in ctx.messages
            if isinstance(m, ModelRequest)
            for p in m.parts
            if isinstance(p, ToolReturnPart)
        }
        step = next(name for name in STEPS if name not in returned)
        return {"temperature": 0, "max_tokens": MAX_TOKENS, "tool_choice": [step]}

    agent = Agent(
        OpenAIChatModel(structured_api.EMBEDDED, provider=provider),
        output_type=ToolOutput(Forecast, name="final_answer"),
        instructions="Answer with the tools.",
        model_settings=settings,
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city, with the temperature in degrees Celsius."""
        calls.append(("get_weather", city))
        return f"Sunny, 21 degrees Celsius in {city}."

    @agent.tool_plain
    def convert_temperature(celsius: float) -> float:
        """Convert degrees Celsius to degrees Fahrenheit."""
        calls.append(("convert_temperature", celsius))
        return celsius * 9 / 5 + 32

    return agent, http


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_pydantic_ai_runs_a_two_tool_loop_to_a_validated_answer(mode, tmp_path):
    calls: list[tuple[str, object]] = []
    bodies: list[dict] = []
    with pdserve_up(structured_api.config(mode), tmp_path) as served:
        agent, http = weather_agent(f"http://{served.http_address}/v1", calls, bodies)
        result = agent.run_sync("What is the weather in Paris, in degrees Fahrenheit?")
        asyncio.run(http.aclose())

    # the tools ran, in the loop's order, on arguments of their types
    assert [name for name, _ in calls] == ["get_weather", "convert_temperature"], calls
    assert isinstance(calls[0][1], str) and isinstance(calls[1][1], float), calls
    # the final answer is the output model's, validated by pydantic
    assert isinstance(result.output, Forecast), result.output
    Forecast.model_validate(result.output.model_dump())

    messages = result.all_messages()
    called = [
        p for m in messages if isinstance(m, ModelResponse) for p in m.parts
        if isinstance(p, ToolCallPart)
    ]  # fmt: skip
    assert [p.tool_name for p in called] == list(STEPS), messages
    # each function tool's result went back in a request the model answered
    returns = {}
    for i, m in enumerate(messages):
        for p in m.parts if isinstance(m, ModelRequest) else ():
            if isinstance(p, ToolReturnPart) and p.tool_name in STEPS[:2]:
                assert isinstance(messages[i + 1], ModelResponse), messages
                returns[p.tool_name] = p
    assert set(returns) == set(STEPS[:2]), messages

    # on the wire: one request per step, naming its tool, all three tools offered; the
    # step's request carries the previous call and its result as a ``role: tool`` message
    assert len(bodies) == len(STEPS), bodies
    for step, body in zip(STEPS, bodies, strict=True):
        assert body["tool_choice"] == {"type": "function", "function": {"name": step}}, body
        assert sorted(t["function"]["name"] for t in body["tools"]) == sorted(STEPS), body
    for name, body in zip(STEPS[:2], bodies[1:], strict=True):
        sent = body["messages"][-1]
        back = returns[name]
        assert sent["role"] == "tool" and sent["tool_call_id"] == back.tool_call_id, body
        assert sent["content"] == back.model_response_str(), (sent, back)
        assert body["messages"][-2]["tool_calls"][0]["function"]["name"] == name, body
    assert served.exit_code == 0, "".join(served.output[-40:])
