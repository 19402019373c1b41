"""Prompt templates for the math tasks, kept as data.

Owns: `TEMPLATES` (name -> format string with one ``{problem}`` field) and `render`. Leaves out:
chat templates (the paper trains base models on raw text; a chat wrapper, if ever needed, belongs
to the tokenizer side) and answer extraction (fspo/rewards/math_verify_reward.py reads both the
``\\boxed{}`` and the ``Answer:`` forms these templates ask for).

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
    """Return ``template`` applied to ``problem``.

    ``template`` is either a name in `TEMPLATES` or a custom format string containing the
    placeholder ``{problem}`` (substituted literally, so braces elsewhere in the template and in the
    problem, e.g. ``\\boxed{}``, are kept as they are). Anything else raises ``ValueError`` naming
    the known templates.
    """
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
