"""Synthetic tasks where position matters: one seeded generator per file, one registry.

``TASKS`` maps a name to its :class:`~lab.tasks.base.Task`; each task has its own small
integer vocabulary and marks the positions it scores (the answers). ``ordinal tasks`` trains a
tiny model per scheme, task and seed on them (``lab.tasks.suite``) and writes docs/tasks.md
(``lab.tasks.report``).
"""

from __future__ import annotations

from lab.tasks import (
    copying,
    counting,
    flipflop,
    indirect,
    longcount,
    needle,
    periodic,
    recall,
    variables,
)
from lab.tasks.base import Task, TaskBatch, TaskError, derive_seed

TASKS: dict[str, Task] = {
    module.TASK.name: module.TASK
    for module in (
        recall,
        copying,
        counting,
        flipflop,
        longcount,
        periodic,
        needle,
        variables,
        indirect,
    )
}


def task(name: str) -> Task:
    """The task called ``name``; an unknown name is a TaskError listing the valid ones."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; valid: {list(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Task", "TaskBatch", "TaskError", "derive_seed", "task"]
