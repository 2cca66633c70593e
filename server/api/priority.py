"""Who may claim which ``priority``: vLLM lets any caller claim any, so on a shared server one
client could hold every other request back. ``--max-priority`` is the most urgent priority
(the lowest number, vLLM's polarity) a request may claim without a priority key; each of
``--priority-keys`` (``KEY:LOWEST``) lets the requests that send ``Authorization: Bearer KEY``
(or ``x-api-key: KEY``) claim LOWEST and above instead. Claiming more is a 403 naming
``priority``, before anything of the request is tokenised or queued. (Aging, which bounds how
long a claimed priority holds others back, is the scheduler's: ``server.engine.scheduler``.)
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers

from server.api.errors import APIError
from server.api.middleware import presented_key
from server.api.settings import Settings, parse_priority_key


class PriorityScopes:
    """The lowest priority each caller may claim: a priority key's own, else ``max_priority``
    (None: any)."""

    def __init__(self, settings: Settings) -> None:
        self.default = settings.max_priority
        self.keys = [
            parse_priority_key(entry.get_secret_value()) for entry in settings.priority_keys
        ]

    def lowest(self, headers: Headers) -> tuple[int | None, bool]:
        """The lowest priority a request with ``headers`` may claim (None: any), and whether a
        priority key set it."""
        given = presented_key(headers)
        for key, lowest in self.keys:
            if secrets.compare_digest(given, key.encode()):
                return lowest, True
        return self.default, False

    def check(self, priority: int, headers: Headers) -> None:
        """A 403 naming ``priority`` when the caller may not claim it."""
        lowest, keyed = self.lowest(headers)
        if lowest is not None and priority < lowest:
            who = "this priority key" if keyed else "a request without a priority key"
            raise APIError(
                403,
                f"priority: {priority} is more urgent than {who} may claim here: {lowest} or "
                "above (a lower number is served sooner; see --max-priority, --priority-keys)",
                param="priority",
                code="priority_not_allowed",
            )
