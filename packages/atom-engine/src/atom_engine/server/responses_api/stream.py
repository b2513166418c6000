"""The SSE events of a streamed response (`event: <type>` / `data: <event JSON>`), in OpenAI's
order: `response.created`, `response.in_progress`; per output item `response.output_item.added`,
then for text (or reasoning) `response.content_part.added`, `response.output_text.delta`s
(`response.reasoning_text.delta`s), `response.output_text.done`, `response.content_part.done`,
for a function call one `response.function_call_arguments.delta` and `.done`; then
`response.output_item.done`; last `response.completed` (or `response.incomplete`) with the
whole response. The text comes from the chat path's `ChatOutput.delta` (reasoning first, text,
and the function calls whole at the end); `sequence_number`s count the events from 0.
"""

from __future__ import annotations

from pydantic import BaseModel

from atom_engine.server.responses import DeltaMessage
from atom_engine.server.responses_api.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionToolCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseLifecycleEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
    new_id,
)


class EventWriter:
    """The events of one response: `start`, `delta` per new piece of the reply, `finish`."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []  # the output so far, open item included
        self._open: OutputMessage | ReasoningOutput | None = None

    def _event(self, event: BaseModel) -> str:
        event.sequence_number = self.sequence_number
        self.sequence_number += 1
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

    def error(self, event: ErrorEvent) -> str:
        return self._event(event)

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self._event(ResponseLifecycleEvent(type=kind, response=response))

    def _item_event(self, kind: str, item: OutputItem) -> str:
        index = self.items.index(item)
        return self._event(OutputItemEvent(type=kind, output_index=index, item=item))

    def _text_events(self, kind: str, text: str) -> list[str]:
        """Open an item of `kind` ("message" or "reasoning") unless one is, then add `text`."""
        events = []
        if self._open is not None and self._open.type != kind:
            events += self._close("completed")
        if self._open is None:
            if kind == "message":
                item = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
                part = OutputText(text="")
            else:
                item = ReasoningOutput(id=new_id("rs"), status="in_progress", content=[])
                part = ReasoningText(text="")
            self.items.append(item)
            events.append(self._item_event("response.output_item.added", item))
            index = self.items.index(item)
            events.append(
                self._event(
                    ContentPartEvent(
                        type="response.content_part.added",
                        item_id=item.id,
                        output_index=index,
                        part=part,
                    )
                )
            )
            item.content.append(part.model_copy())
            self._open = item
        item = self._open
        item.content[0].text += text
        prefix = "output_text" if kind == "message" else "reasoning_text"
        delta = TextDeltaEvent(
            type=f"response.{prefix}.delta",
            item_id=item.id,
            output_index=self.items.index(item),
            delta=text,
        )
        events.append(self._event(delta))
        return events

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = self.items.index(item), item.content[0]
        prefix = "output_text" if item.type == "message" else "reasoning_text"
        item.status = status
        done = TextDoneEvent(
            type=f"response.{prefix}.done", item_id=item.id, output_index=index, text=part.text
        )
        part_done = ContentPartEvent(
            type="response.content_part.done", item_id=item.id, output_index=index, part=part
        )
        return [
            self._event(done),
            self._event(part_done),
            self._item_event("response.output_item.done", item),
        ]

    def delta(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._text_events("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text_events("message", delta.content)
        return events

    def finish(self, delta: DeltaMessage | None, status: str) -> list[str]:
        """The last delta (with the function calls, if any); the open item closes as `status`."""
        events = self.delta(delta) if delta is not None else []
        events += self._close(status)
        for call in (delta.tool_calls if delta is not None else None) or []:
            name, arguments = call.function.name, call.function.arguments
            item = FunctionToolCall(
                id=new_id("fc"),
                call_id=new_id("call"),
                name=name,
                arguments="",
                status="in_progress",
            )
            self.items.append(item)
            index = len(self.items) - 1
            events.append(self._item_event("response.output_item.added", item))
            delta_event = ArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=arguments)
            events.append(self._event(delta_event))
            events.append(
                self._event(
                    ArgumentsDoneEvent(
                        item_id=item.id, output_index=index, name=name, arguments=arguments
                    )
                )
            )
            item.arguments, item.status = arguments, status
            events.append(self._item_event("response.output_item.done", item))
        return events
