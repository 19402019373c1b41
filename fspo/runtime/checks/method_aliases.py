"""The older ways to pick a method on the command line: they still compose the same config for one more release,
each with one deprecation line (stderr) naming the form that replaces it.

- ``clip=<rule>`` / ``+clip=<rule>`` swaps the clip rule alone. A method is picked with ``+method=<name>``
  (conf/method/<name>.yaml: the rule, its advantage and its aggregation); every rule in conf/clip/ has a method
  of the same name. One setting is still ``clip.<key>=<value>``.
- ``+arm=<arm>`` / ``arm=<arm>`` with no ``--config-dir``: sweep arms live beside their sweeps, in sweeps/arm/;
  ``--config-dir sweeps`` is added, so the command composes as before.
Leaves out: ``group=x`` vs ``+group=x`` (command_line.py `normalize_group_overrides`) and refusing bad keys.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Sequence, Set

SWEEPS_DIR = Path(__file__).resolve().parents[3] / "sweeps"
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
_SAID: Set[str] = set()  # the checks read the command line more than once: each line is printed once


def selection(arg: str, group: str) -> Optional[str]:
    """``x`` for ``group=x`` or ``+group=x`` (``x`` may be a sweep's ``a,b``), else None."""
    key, eq, value = arg.partition("=")
    return value if eq and key in (group, f"+{group}") else None


def _arm_without_dir(argv: Sequence[str]) -> bool:
    """An arm is selected and no ``--config-dir`` / ``-cd`` says where configs beyond conf/ are."""
    given = any(a in CONFIG_DIR_FLAGS or a.startswith(tuple(f"{f}=" for f in CONFIG_DIR_FLAGS)) for a in argv)
    return not given and any(selection(a, "arm") is not None for a in argv)


def deprecations(argv: Sequence[str]) -> List[str]:
    """One line per old form in ``argv``, naming the form that replaces it."""
    lines = []
    bare_arm = _arm_without_dir(argv)
    for a in argv:
        if (rule := selection(a, "clip")) is not None:
            lines.append(f"'{a}' is deprecated and will be removed in the next release: pick the method with "
                         f"'+method={rule}' (conf/method/: the rule with its advantage and aggregation)")
        elif bare_arm and selection(a, "arm") is not None:
            lines.append(f"'{a}' without --config-dir is deprecated and will be removed in the next release: "
                         f"sweep arms live beside their sweeps (sweeps/arm/); add '--config-dir sweeps'")
    return lines


def legacy_forms(argv: Sequence[str]) -> List[str]:
    """``argv`` as it composes today (``--config-dir <sweeps>`` added for an arm given without a config folder),
    after printing each deprecation line of `deprecations` once per process."""
    lines = deprecations(argv)
    for line in lines:
        if line not in _SAID:
            _SAID.add(line)
            print(f"warning: {line}", file=sys.stderr)
    if _arm_without_dir(argv):
        return [*argv, "--config-dir", str(SWEEPS_DIR)]
    return list(argv)
