"""A tool-using agent written with the plain ``openai`` client, as a user would write it: the worked example of
docs/agents.md, played against the gateway by tests/integration/test_gateway_run.py.

Consumes: the gateway's base URL, an episode id (sent as the API key) and a task seed.
Produces: one episode: the model is asked a sum with a ``calc`` tool offered; a tool call is answered by the
calculator, anything else gets the calculator's result as a user message; the second answer is graded by the
agent's own environment, and the episode is ended with that reward (``POST /v1/episodes/{id}/end``).
Guarantees: nothing about the gateway is imported; only ``base_url`` and the API key differ from any OpenAI agent.
The grade is the share of digits in the final answer (a dense signal a tiny policy can learn in a few steps).
"""

from __future__ import annotations

import json
import random
import urllib.request

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def calculator(arguments: str) -> str:
    values = json.loads(arguments or "{}")
    return str(int(values.get("a", 0)) + int(values.get("b", 0)))


def grade(answer: str) -> float:
    """The environment's reward: the share of the answer's characters that are digits."""
    return sum(c.isdigit() for c in answer) / len(answer) if answer else 0.0


def play(base_url: str, episode: str, seed: int, max_tokens: int = 6) -> float:
    """Play one episode and end it with its reward; the reward."""
    rng = random.Random(seed)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    client = openai.OpenAI(base_url=base_url, api_key=episode, max_retries=0)
    messages = [{"role": "user", "content": f"What is {a}+{b}? Use the calculator."}]
    answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens)
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    else:
        messages.append({"role": "user", "content": f"The calculator says {a + b}. Answer with the number."})
    final = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens)
    reward = grade(final.choices[0].message.content or "")
    end = urllib.request.Request(f"{base_url}/episodes/{episode}/end", data=json.dumps({"reward": reward}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(end, timeout=120) as done:
        json.loads(done.read())
    return reward
