"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, the
most recently used `size` of them (`atom serve --responses-store-size`); the oldest goes first.

Each entry holds the response body and its conversation as chat messages (the earlier turns,
this request's input and its output; not its `instructions`, which OpenAI does not carry to the
next turn). Only the event loop touches it: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from atom_engine.server.responses_api.objects import ResponseObject

DEFAULT_STORE_SIZE = 1024


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict]  # the conversation so far, as the chat template gets it


class ResponseStore:
    def __init__(self, size: int = DEFAULT_STORE_SIZE) -> None:
        if size < 0:
            raise ValueError(f"the responses store size must be >= 0, got {size}")
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.size == 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
