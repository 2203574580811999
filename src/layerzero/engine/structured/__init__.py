"""Structured outputs (issue 39): the output follows a JSON schema, any JSON object, a regex, one of a list of
choices or an EBNF grammar (:class:`~layerzero.engine.structured_params.StructuredOutputsParams`).

- :mod:`.select`: which grammar backend takes a constraint (xgrammar by default, llguidance where xgrammar
  cannot compile it or where ``backend="guidance"`` asks), with the reason; a constraint neither compiles is
  an ``InvalidInputError`` before anything is queued. No tokenizer needed (the front end calls it too).
- :mod:`.backends`: the two backends behind one small matcher interface (accept a token, fill a row of the
  packed token bitmask, terminated?), compiled against the tokenizer's vocabulary.
- :mod:`.manager`: the engine core's state: one matcher per sequence, compiled grammars cached per constraint,
  the step's bitmask filled on the host (deferred until the forward is launched).

The libraries are imported lazily (no import side effects); docs/decoding.md, "Structured outputs".
"""

from .select import Selection, check_request, select_backend

# the manager (the engine core's side, ``.manager.StructuredOutputManager``) is not imported here: it imports
# the scheduler output, and the front end imports this package for check_request only (.importlinter)
__all__ = ["Selection", "check_request", "select_backend"]
