"""Prompt templates for the math tasks, kept as data (no chat template: the paper trains base models on raw text).

- ``boxed``: Qwen3 / Qwen2.5-Math base-model style; the instruction AIME25's prompts already carry.
- ``dapo``:  the DAPO-Math-17k training template (answer on a final ``Answer: ...`` line).
- ``raw``:   the bare problem.
"""
from __future__ import annotations

from typing import Dict

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

TEMPLATES: Dict[str, str] = {
    "boxed": "{problem}\n" + BOXED_INSTRUCTION,
    "dapo": (
        "Solve the following math problem step by step. The last line of your response should be of "
        "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        "{problem}\n\nRemember to put your answer on its own line after \"Answer:\"."
    ),
    "raw": "{problem}",
}


def render(template: str, problem: str) -> str:
    """``template`` (a name in `TEMPLATES` or a string containing ``{problem}``, substituted literally) applied to
    ``problem``; ValueError naming the known templates otherwise."""
    if not isinstance(template, str):
        raise ValueError(f"template must be a string, got {type(template).__name__}")
    fmt = TEMPLATES.get(template)
    if fmt is None:
        if "{problem}" not in template:
            raise ValueError(
                f"unknown prompt template {template!r}: use one of {sorted(TEMPLATES)} "
                "or a custom string containing '{problem}' (set data.template)")
        fmt = template
    return fmt.replace("{problem}", problem)
