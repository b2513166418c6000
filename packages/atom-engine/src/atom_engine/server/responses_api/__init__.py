"""The OpenAI Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`), served
through the chat path: `protocol` (requests), `objects` (response bodies and stream events),
`convert` (input items -> chat messages, a chat reply -> output items), `store` (the responses
kept for `previous_response_id`), `stream` (the SSE events), `serving` (the routes)."""
