"""Final-answer extraction from a completion, and the exact fast path of the math reward: linear-time regular
expressions and a brace counter, nothing evaluated, the answer capped at ``max_chars`` (longer: no answer)."""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional, Tuple

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER = re.compile(r"\banswer\b\**\s*[:：]\**[ \t]*([^\n]*)", re.IGNORECASE)
_WRAPPERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))
_CANON_DROP = re.compile(r"\\left|\\right|\\[!,;: ]|\\displaystyle|\$|\s+")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def last_boxed(text: str, max_chars: int = 1000) -> Optional[Tuple[str, int]]:
    """(content, position) of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces, ``\\{`` literal) or
    ``\\boxed X`` (one token); None when the last box is empty or unclosed within ``max_chars``."""
    starts = [m for m in _BOXED.finditer(text)]
    if not starts:
        return None
    m = starts[-1]
    i = m.end()
    if i < len(text) and text[i] == "{":
        depth, j, end = 0, i, min(len(text), i + max_chars + 2)
        while j < end:
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    content = text[i + 1:j].strip()
                    return (content, m.start()) if content else None
            j += 1
        return None
    tok = re.match(r"[^\s$]+", text[i:i + max_chars + 1])
    if tok and len(tok.group(0)) <= max_chars:
        return tok.group(0), m.start()
    return None


def last_answer_line(text: str) -> Optional[Tuple[str, int]]:
    """(content, position) of the last non-empty ``Answer: ...`` line (case-insensitive, ``**Answer:** 5`` too)."""
    best = None
    for m in _ANSWER.finditer(text):
        if m.group(1).strip():
            best = (m.group(1).strip(), m.start())
    return best


def clean_answer(ans: str) -> str:
    """Strip math delimiters (``$..$``, ``\\(..\\)``, ``\\[..\\]``), markdown bold and a trailing period."""
    s = ans.strip()
    changed = True
    while changed and s:
        changed = False
        for left, right in _WRAPPERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                s, changed = s[len(left):len(s) - len(right)].strip(), True
        if s.endswith((".", "。")) and not s.endswith(".."):
            s, changed = s[:-1].rstrip(), True
    return s


def extract_answer(text: str, max_chars: int = 1000) -> Optional[str]:
    """Whichever of the last ``\\boxed{}`` and the last ``Answer:`` line comes later, cleaned; None when there is
    none, it is empty, or longer than ``max_chars``."""
    box = last_boxed(text, max_chars)
    line = last_answer_line(text)
    if box is None and line is None:
        return None
    if box is not None and (line is None or box[1] >= line[1]):
        ans = box[0]
    else:
        ans = line[0]
        inner = last_boxed(ans, max_chars)  # "Answer: \boxed{5}" is caught above; "Answer: x = \boxed{5}" too
        ans = inner[0] if inner else ans
    ans = clean_answer(ans)
    return ans if ans and len(ans) <= max_chars else None


def canonical(ans: str) -> str:
    """A light canonical form: no spacing commands, ``\\left``/``\\right``, ``$`` or whitespace;
    ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``1,000`` -> ``1000``."""
    s = _CANON_DROP.sub("", ans.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac"))
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def _number(s: str) -> Optional[Fraction]:
    if _NUMBER.match(s) and len(s) <= 64:
        return Fraction(s)
    return None


def _strip_percent(s: str) -> str:
    for suffix in ("\\%", "\\percent", "%"):
        if s.endswith(suffix):
            return s[: -len(suffix)]
    return s


def fast_equal(pred: str, ref: str) -> Optional[bool]:
    """True when the canonical strings or plain-number values match (also after dropping a trailing percent
    sign); False when both are plain numbers without percent signs and differ; None (ask math-verify) otherwise."""
    a, b = canonical(pred), canonical(ref)
    if a == b:
        return True
    a2, b2 = _strip_percent(a), _strip_percent(b)
    x, y = _number(a2), _number(b2)
    if a2 == b2 or (x is not None and y is not None and x == y):
        return True
    if x is not None and y is not None and a2 == a and b2 == b:
        return False
    return None
