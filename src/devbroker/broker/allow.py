"""The earlier name of the rule tables: everything here is rules.py's own objects.

New code uses devbroker.broker.rules. `ESCAPES` here is a read-only view of rules.ESCAPES and
rules.UVM_COMMANDS together (before the UVM commands had their own table); the other names
are the very tables of rules.py, so a row added through this module lands there.
"""
from __future__ import annotations

from collections import ChainMap

from devbroker.broker.rules import (  # noqa: F401  (re-exported)
    ANSWERED_CONTROLS, CAPABILITIES, CLASSES, CONTROLS, DEFAULT_CAPABILITIES,
    DEVICE_MEMORY_CLASSES, REFUSED_CLASSES, REFUSED_CONTROLS, REFUSED_ESCAPES, RM_NODES,
    UVM_COMMANDS, UVM_NODES, ClassRule, ControlRule, EscapeRule, Rule, check_open, class_rule,
    control_refusal, control_rule, escape_rule, in_caller_reason, simple_control,
)
from devbroker.broker.rules import ESCAPES as _ESCAPES

ESCAPES = ChainMap(_ESCAPES, UVM_COMMANDS)
