"""The weather tool that the demo's and the training loop's agents call."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def weather_tools(cities: Sequence[str]) -> list[dict[str, Any]]:
    """The `get_weather` tool (Chat Completions shape), its city one of `cities`."""
    return [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": list(cities)}},
                    "required": ["city"],
                },
            },
        }
    ]


def weather(city: str) -> str:
    """The tool's answer: deterministic, so a transcript is reproducible."""
    temperature = 5 + sum(map(ord, city)) % 25
    return json.dumps({"city": city, "temperature_c": temperature, "sky": "clear"})
