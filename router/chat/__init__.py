"""Chat APIs per session (OpenAI Chat Completions, Anthropic Messages) over token-in-token-out
turns: :mod:`router.chat.openai_routes`, :mod:`router.chat.anthropic_routes`, the shared turn
(:mod:`router.chat.service`), the context derived from the stored trajectory
(:mod:`router.chat.conversation`) and one renderer per model family (:mod:`router.chat.renderers`)."""
