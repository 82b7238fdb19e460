"""Transition tables: declared with ``transitions``, stepped as a dict.

Each machine declares its states and allowed transitions once, as a
``transitions.Machine`` (auto transitions off). That object is the truth: it
validates the table when the module loads and draws the diagram
(``Table.diagram()``, mermaid, generated, never drawn by hand).

Stepping a ``transitions`` model costs tens of microseconds per request
(``add_model`` plus callbacks), which the request path cannot afford at
100k tokens/s, so the table is compiled once into ``{(state, event): dest}``
and machines step with one dict lookup. An event the table does not allow
raises ``ProtocolError`` naming the machine, state and event: never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from transitions import Machine


class ProtocolError(Exception):
    """An event arrived that the machine's table does not allow in its state.

    Always our bug or a peer's protocol violation; the shell decides whose by
    where the event came from, the machine only says what happened.
    """

    def __init__(self, machine: str, machine_id: str, state: str, event: str) -> None:
        super().__init__(f"{machine} {machine_id!r}: event {event!r} is not allowed in state {state!r}")
        self.machine = machine
        self.machine_id = machine_id
        self.state = state
        self.event = event


@dataclass(frozen=True)
class Table:
    name: str
    states: tuple[str, ...]
    initial: str
    terminal: frozenset[str]
    steps: dict[tuple[str, str], str]
    machine: Machine

    def next_state(self, machine_id: str, state: str, event: str) -> str:
        try:
            return self.steps[(state, event)]
        except KeyError:
            raise ProtocolError(self.name, machine_id, state, event) from None

    def allows(self, state: str, event: str) -> bool:
        return (state, event) in self.steps

    def diagram(self) -> str:
        """A mermaid state diagram of the table."""
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial}"]
        for (source, event), dest in sorted(self.steps.items()):
            lines.append(f"    {source} --> {dest}: {event}")
        for state in sorted(self.terminal):
            lines.append(f"    {state} --> [*]")
        return "\n".join(lines)


def build_table(
    name: str,
    states: list[str],
    transitions: list[tuple[str, str | list[str], str]],
    initial: str,
    terminal: set[str],
) -> Table:
    """Declare a table with ``transitions`` and compile it for stepping.

    States and events may be str enums; they are reduced to plain strings
    because ``transitions`` names Enum states by their member names.
    """
    states = [_plain(s) for s in states]
    transitions = [
        (_plain(event), [_plain(s) for s in source] if isinstance(source, list) else _plain(source), _plain(dest))
        for event, source, dest in transitions
    ]
    initial = _plain(initial)
    terminal = {_plain(s) for s in terminal}
    machine = Machine(
        model=None,
        states=states,
        transitions=[list(t) for t in transitions],
        initial=initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )
    steps: dict[tuple[str, str], str] = {}
    for event_name, event in machine.events.items():
        for source, event_transitions in event.transitions.items():
            for transition in event_transitions:
                key = (source, event_name)
                if key in steps and steps[key] != transition.dest:
                    raise ValueError(f"{name}: {key} has two destinations")
                steps[key] = transition.dest
    for state in terminal:
        leaving = [k for k in steps if k[0] == state]
        if leaving:
            raise ValueError(f"{name}: terminal state {state!r} has transitions {leaving}")
    return Table(name, tuple(states), initial, frozenset(terminal), steps, machine)


def _plain(value: str) -> str:
    return str(value.value) if isinstance(value, Enum) else str(value)
